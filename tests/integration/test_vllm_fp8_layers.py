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

For DeepSeek-V3 / Kimi-K2 the whole FP8 model is built (vLLM's `DeepseekV3ForCausalLM`) and
filled by its own `load_weights`; then vLLM's MLA derivation turns `kv_b_proj`'s FP8 weight and
scales into `W_UK_T`/`W_UV`, checked against a dequantization written here, before and after an
in-place write of new FP8 bytes.
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


# -- DeepSeek-V3 / Kimi-K2: vLLM's whole FP8 model, its loader, and the MLA derivation ----------

MLA_FP8_CONFIG: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
"""Kimi-K2's structure with every fused part and tensor-parallel cut on a 128 boundary at tp 1
and 2 (q_b_proj and kv_b_proj: 128 rows per head; o_proj: 2 heads x 64 columns per rank)."""


def _hf_mla_checkpoint(shape: Any, seed: int) -> dict[str, torch.Tensor]:
    """Full BF16 trainer tensors (one per expert, the checkpoint layout), float32 router bias."""
    from weight_transfer.planner.presets.deepseek import mla_parameter_shapes, mla_source_dtypes

    g = torch.Generator().manual_seed(seed)
    dtypes = mla_source_dtypes(shape)
    return {
        n: (torch.randn(s, generator=g) * 0.5).to(getattr(torch, dtypes.get(n, "bfloat16")))
        for n, s in mla_parameter_shapes(shape).items()
    }


def _dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Block dequantization written here: every 128x128 block times its scale, in float32."""
    rows, cols = w.shape
    full = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return w.to(torch.float32) * full


def _mla_worker(rank: int, world: int, port: int, model_dir: str, out: Any) -> None:
    import os

    os.environ["VLLM_DIST_IDENT"] = str(port)
    import vllm.model_executor.layers.quantization.fp8 as fp8_module
    from vllm.config import AttentionConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from weight_transfer.planner.fp8 import quantize_fp8_blockwise
    from weight_transfer.planner.presets.models import from_hf_config
    from weight_transfer.planner.presets.vllm import vllm_layout
    from weight_transfer.planner.reference import materialize

    fp8_module.init_fp8_linear_kernel = lambda *a, **k: None  # type: ignore[attr-defined]
    vc = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128
        ),
        # vLLM's reference MLA backend, named: on CPUs with AMX tiles vLLM picks AMX_MLA.
        attention_config=AttentionConfig(backend=AttentionBackendEnum.CPU_MLA),
    )
    bad: list[str] = []
    names: list[str] = []
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
            with set_default_torch_dtype(torch.bfloat16):
                model = initialize_model(vllm_config=vc)
            shape = from_hf_config(vc.model_config.hf_config)
            layout = vllm_layout(shape, rank, world, fp8=True)
            specs = layout.specs("bfloat16")
            mla = {n: m for n, m in model.named_modules() if isinstance(m, MLAAttention)}

            def checkpoint(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                """A pre-quantized checkpoint: every linear weight per 128x128 block."""
                ckpt = {}
                quantized = {p.source for r in layout.recipes if r.quant for p in r.parts}
                for n, t in full.items():
                    if n in quantized:
                        w, s = quantize_fp8_blockwise(t.float(), (128, 128))
                        ckpt[n], ckpt[n + "_scale_inv"] = w, s
                    else:
                        ckpt[n] = t
                return ckpt

            def derived_want(want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                """W_UK_T / W_UV from the recipes' FP8 kv_b_proj, sliced here."""
                n_r = shape.num_heads // world
                p_, v_, l_ = shape.qk_nope_head_dim, shape.v_head_dim, shape.kv_lora_rank
                exp = {}
                for mod_name in mla:
                    kv = mod_name.replace("mla_attn.mla_attn", "kv_b_proj.weight")
                    w = _dequant(want[kv], want[kv + "_scale_inv"]).to(torch.bfloat16)
                    w = w.T.reshape(l_, n_r, p_ + v_)
                    exp[mod_name + ".W_UK_T"] = w[..., :p_].permute(1, 2, 0)
                    exp[mod_name + ".W_UV"] = w[..., p_:].transpose(0, 1)
                return exp

            # 1. vLLM's own loader on a pre-quantized checkpoint; the recipes on the same weights.
            full = _hf_mla_checkpoint(shape, seed=11 + 0)
            model.load_weights(iter(checkpoint(full).items()))
            want = materialize(layout.recipes, specs, full)
            live = dict(model.named_parameters())
            names = sorted(live)
            for s in specs:
                t = live.get(s.name)
                if t is None:
                    bad.append(f"{s.name}: not in vLLM's model")
                    continue
                t = t.detach()
                if s.name in ("model.embed_tokens.weight", "lm_head.weight"):
                    t = t[: s.shape[0]]  # the real rows of the padded shard
                if tuple(t.shape) != tuple(s.shape) or str(t.dtype) != f"torch.{s.dtype}":
                    bad.append(f"{s.name}: vLLM {tuple(t.shape)} {t.dtype}, recipe {s.shape}")
                elif not torch.equal(t.view(torch.uint8), want[s.name].view(torch.uint8)):
                    bad.append(f"{s.name}: bytes differ")
            # 2. vLLM's MLA derivation from the FP8 kv_b_proj (dequantized with its scales).
            for m in mla.values():
                m.process_weights_after_loading(torch.bfloat16)
            live = dict(model.named_parameters())
            ptrs = {n: live[n].data_ptr() for n in derived_want(want)}
            for n, t in derived_want(want).items():
                if not torch.equal(live[n], t):
                    bad.append(f"{n}: not the dequantized kv_b_proj")
            # 3. The plug-in's update: new FP8 bytes written in place into kv_b_proj (and every
            # other tensor), then vLLM's derivation re-run: the derived tensors follow.
            full2 = _hf_mla_checkpoint(shape, seed=12)
            want2 = materialize(layout.recipes, specs, full2)
            with torch.no_grad():
                for s in specs:
                    t = live[s.name].data
                    t = (
                        t[: s.shape[0]]
                        if s.name.endswith(("embed_tokens.weight", "lm_head.weight"))
                        else t
                    )
                    t.copy_(want2[s.name])
            for m in mla.values():
                m.process_weights_after_loading(torch.bfloat16)
            live = dict(model.named_parameters())
            for n, t in derived_want(want2).items():
                if not torch.equal(live[n], t):
                    bad.append(f"{n}: not re-derived from the new kv_b_proj")
                if torch.equal(live[n], derived_want(want)[n]):
                    bad.append(f"{n}: unchanged by the update")
                if live[n].data_ptr() != ptrs[n]:
                    bad.append(f"{n}: re-derivation moved it (CUDA graphs would read stale memory)")
        out.put((rank, names, bad))
    except BaseException as exc:
        out.put((rank, names, [f"{type(exc).__name__}: {exc}"]))
        raise


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_fp8_recipes_equal_vllms_loader_and_derivation(tp: int, tmp_path: Path) -> None:
    """vLLM's own FP8 DeepseekV3ForCausalLM (Kimi-K2's class) on CPU, filled by vLLM's own
    `load_weights` from a block-FP8 checkpoint: every weight and scale equals the FP8 recipes'
    bytes (fused_qkv_a_proj, q_b/kv_b/o_proj by heads, dense and shared MLPs, w13/w2 with their
    3-D scales; router, bias, norms and embeddings unquantized). Then vLLM's MLA derivation turns
    kv_b_proj's FP8 weight and scales into W_UK_T/W_UV equal to a dequantization written here,
    and after new FP8 bytes are written in place (as the plug-in does) re-running it gives the
    new ones, in the same memory."""
    import json

    from transformers import DeepseekV3Config

    from weight_transfer.cli.run_demo import free_port

    DeepseekV3Config(**MLA_FP8_CONFIG, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(
        tmp_path
    )
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    port = free_port()
    results: dict[int, tuple[list[str], list[str]]] = {}

    def report(_child: str, msg: list[Any]) -> None:
        rank, names, bad = msg
        results[rank] = (names, bad)

    outcome = Launch(
        [Child(f"tp{r}", _mla_worker, (r, tp, port, str(tmp_path))) for r in range(tp)]
    ).run(timeout_s=420, grace_s=60, on_message=report)
    assert len(results) == tp, f"only {len(results)} of {tp} ranks reported: {outcome.errors}"
    for rank, (names, bad) in sorted(results.items()):
        assert bad == [], f"tp rank {rank}: {bad}"
        # FP8 linears: 6 in the dense layer, 8 in the MoE layer (shared MLP, w13, w2).
        assert sum(n.endswith("weight_scale_inv") for n in names) == 14
        assert "model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv" in names
    assert outcome.exit_codes == {f"tp{r}": 0 for r in range(tp)}, outcome.errors
