"""The FP8 recipes against vLLM's real block-FP8 linear layers, as vLLM's loader fills them.

vLLM's CPU backend cannot run block-FP8 matmuls without AMX, so no FP8 engine runs here. The
layers themselves can be built: `QKVParallelLinear`, `MergedColumnParallelLinear` and
`RowParallelLinear` with vLLM's `Fp8Config` (block 128x128) create their `weight`
(float8_e4m3fn) and `weight_scale_inv` (float32) parameters with vLLM's own `create_weights`,
and vLLM's `weight_loader`s fill them from a pre-quantized checkpoint (every HF tensor quantized
per 128x128 block). Only the choice of a matmul kernel is stubbed (it refuses without AMX and
is not used: nothing is computed). With every fused part and tensor-parallel cut on a block
boundary, what vLLM's loader places must equal what this project's FP8 recipes write, bit for
bit, weight and scales, at tp=1 and tp=2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.markers import requires_module
from weight_transfer.cli.launch import Child, Launch

pytestmark = [requires_module("vllm"), pytest.mark.timeout(600)]

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 256, 4, 2, 128, 512


def _worker(rank: int, world: int, port: int, model_dir: str, out: Any) -> None:
    import os

    # vLLM's CPU worker sets this before it builds the parallel state (cpu_worker.py,
    # `init_device`); its shared-memory communicator reads it. This test builds the parallel
    # state by hand, so it sets it the same way (from the init method's port).
    os.environ["VLLM_DIST_IDENT"] = str(port)
    import vllm.model_executor.layers.quantization.fp8 as fp8_module
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from weight_transfer.planner.fp8 import quantize_fp8_blockwise
    from weight_transfer.planner.presets.models import ModelShape
    from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
    from weight_transfer.planner.reference import materialize

    # The only stub: vLLM picks a block-FP8 matmul kernel at create_weights time, and every CPU
    # kernel needs AMX. No matmul runs in this test.
    fp8_module.init_fp8_linear_kernel = lambda *a, **k: None  # type: ignore[attr-defined]
    vc = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True)
    )
    try:
        with set_current_vllm_config(vc):
            init_distributed_environment(
                world_size=world,
                rank=rank,
                local_rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                backend="gloo",
            )
            initialize_model_parallel(world)
            cfg = Fp8Config(
                is_checkpoint_fp8_serialized=True,
                activation_scheme="dynamic",
                weight_block_size=[128, 128],
            )
            p = "model.layers.0."
            layers = {
                p + "self_attn.qkv_proj": QKVParallelLinear(
                    H,
                    HEAD_DIM,
                    HEADS,
                    KV_HEADS,
                    bias=False,
                    quant_config=cfg,
                    prefix=p + "self_attn.qkv_proj",
                    params_dtype=torch.bfloat16,
                ),
                p + "self_attn.o_proj": RowParallelLinear(
                    HEADS * HEAD_DIM,
                    H,
                    bias=False,
                    quant_config=cfg,
                    prefix=p + "self_attn.o_proj",
                    params_dtype=torch.bfloat16,
                ),
                p + "mlp.gate_up_proj": MergedColumnParallelLinear(
                    H,
                    [INTER, INTER],
                    bias=False,
                    quant_config=cfg,
                    prefix=p + "mlp.gate_up_proj",
                    params_dtype=torch.bfloat16,
                ),
                p + "mlp.down_proj": RowParallelLinear(
                    INTER,
                    H,
                    bias=False,
                    quant_config=cfg,
                    prefix=p + "mlp.down_proj",
                    params_dtype=torch.bfloat16,
                ),
            }
            g = torch.Generator().manual_seed(5)
            hf = {
                p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
                p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
                p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
                p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
                p + "mlp.gate_proj.weight": (INTER, H),
                p + "mlp.up_proj.weight": (INTER, H),
                p + "mlp.down_proj.weight": (H, INTER),
            }
            full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf.items()}
            ckpt = {n: quantize_fp8_blockwise(t.float(), (128, 128)) for n, t in full.items()}
            shard_of = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1}
            for n, (w, s) in ckpt.items():
                mod, leaf = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]
                fused = {
                    "q_proj": "qkv_proj",
                    "k_proj": "qkv_proj",
                    "v_proj": "qkv_proj",
                    "gate_proj": "gate_up_proj",
                    "up_proj": "gate_up_proj",
                }.get(leaf, leaf)
                layer = layers[mod + "." + fused]
                for pname, value in (("weight", w), ("weight_scale_inv", s)):
                    param = getattr(layer, pname)
                    if leaf in shard_of:
                        param.weight_loader(param, value, shard_of[leaf])
                    else:
                        param.weight_loader(param, value)
            got = {
                f"{m}.{n}": t.detach().clone()
                for m, layer in layers.items()
                for n, t in layer.named_parameters()
            }
            shape = ModelShape(
                vocab_size=128,
                hidden_size=H,
                intermediate_size=INTER,
                num_layers=1,
                num_heads=HEADS,
                num_kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
            )
            recipes = vllm_recipes(shape, rank, world, fp8=True)
            specs = [s for s in vllm_tensor_specs(shape, rank, world, fp8=True) if s.name in got]
            mine = [r for r in recipes if r.dest in got]
            want = materialize(mine, specs, full)
            bad = []
            for s in specs:
                t = got[s.name]
                if tuple(t.shape) != tuple(s.shape) or str(t.dtype) != f"torch.{s.dtype}":
                    bad.append(
                        f"{s.name}: vLLM {tuple(t.shape)} {t.dtype}, recipe {s.shape} {s.dtype}"
                    )
                elif not torch.equal(t.view(torch.uint8), want[s.name].view(torch.uint8)):
                    bad.append(f"{s.name}: bytes differ")
            out.put((rank, sorted(got), bad))
    except BaseException as exc:
        out.put((rank, [], [f"{type(exc).__name__}: {exc}"]))
        raise


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_recipes_equal_vllms_fp8_loader(tp: int, tmp_path: Path) -> None:
    from transformers import LlamaConfig

    from weight_transfer.cli.run_demo import free_port

    LlamaConfig(
        vocab_size=128,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    ).save_pretrained(tmp_path)
    port = free_port()
    results: dict[int, tuple[list[str], list[str]]] = {}

    def report(_child: str, msg: list[Any]) -> None:
        rank, names, bad = msg
        results[rank] = (names, bad)

    outcome = Launch(
        [Child(f"tp{r}", _worker, (r, tp, port, str(tmp_path))) for r in range(tp)]
    ).run(timeout_s=360, grace_s=60, on_message=report)
    assert len(results) == tp, f"only {len(results)} of {tp} ranks reported: {outcome.errors}"
    for rank, (names, bad) in sorted(results.items()):
        assert bad == [], f"tp rank {rank}: {bad}"
        # Every FP8 weight and scale of the four layers was compared.
        assert len(names) == 8 and sum(n.endswith("weight_scale_inv") for n in names) == 4
    assert outcome.exit_codes == {f"tp{r}": 0 for r in range(tp)}, outcome.errors
