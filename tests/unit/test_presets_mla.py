"""MLA (DeepSeek-V3 / Kimi-K2) and GLM-4.5-MoE presets: trainer names against transformers'
modules, coverage of every element, HF configs, dtypes, and the MTP layer's refusal.

The engine side (names, shapes and dtypes as a live vLLM holds them) is checked against vLLM's
own model in tests/integration/test_vllm_mla.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from weight_transfer.backends.base import PlanMismatchError
from weight_transfer.errors import ConfigurationError
from weight_transfer.planner.plan import plan
from weight_transfer.planner.presets.deepseek import (
    MLA_SHAPES,
    MlaShape,
    mla_from_hf_config,
    mla_parameter_shapes,
    mla_recipes,
    mla_source_dtypes,
)
from weight_transfer.planner.presets.models import (
    ModelShape,
    dense_from_hf_config,
    from_hf_config,
    hf_parameter_shapes,
)
from weight_transfer.planner.presets.vllm import DEFAULT_MOE_PREFIX, ROUTER_BIAS, vllm_layout
from weight_transfer.planner.recipes import recipe_shape
from weight_transfer.planner.types import box_in, full_box

KIMI_K2_CONFIG: dict[str, Any] = {
    # moonshotai/Kimi-K2-Instruct config.json, the keys a shape reads (and the MTP count).
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
}
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    **KIMI_K2_CONFIG,
    # deepseek-ai/DeepSeek-V3 config.json differs in these.
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
}

_TINY_DSV3: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
}
_TINY_GLM: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "attention_bias": True,
    "use_qk_norm": True,
}


def _transformers_model(config_cls: str, cfg: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch
    import transformers

    config = getattr(transformers, config_cls)(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return config, model.state_dict()


@pytest.mark.parametrize(
    ("config_cls", "extra"),
    [
        ("DeepseekV3Config", {}),
        ("DeepseekV3Config", {"q_lora_rank": None}),
        ("DeepseekV3Config", {"n_shared_experts": 2, "first_k_dense_replace": 0}),
        ("Glm4MoeConfig", {}),
        ("Glm4MoeConfig", {"attention_bias": False, "use_qk_norm": False, "n_shared_experts": 2}),
    ],
)
def test_trainer_tensors_equal_transformers_state_dict(
    config_cls: str, extra: dict[str, Any]
) -> None:
    """Every name and shape of a real transformers model's checkpoint (parameters and the
    router-bias buffers)."""
    base = _TINY_DSV3 if config_cls.startswith("Deepseek") else _TINY_GLM
    config, state = _transformers_model(config_cls, {**base, **extra})
    actual = {n: tuple(t.shape) for n, t in state.items()}
    shape = from_hf_config(config)
    assert shape == from_hf_config(config.to_dict())
    if isinstance(shape, MlaShape):
        # transformers' DeepseekV3Config does not save topk_method (real V3 configs do), and
        # vLLM then builds neither a bias nor sigmoid routing: a plan from a trainer holding
        # the bias fails on it as an extra tensor.
        assert not shape.router_bias
        got = mla_parameter_shapes(shape, moe_layout="fused")
        assert set(actual) - set(got) == {n for n in actual if ROUTER_BIAS in n} != set()
        shape = dataclasses.replace(shape, router_bias=True)
        assert mla_parameter_shapes(shape, moe_layout="fused") == actual
        # float32 in a bf16 trainer (transformers' _keep_in_fp32_modules_strict, applied by
        # from_pretrained: the integration tests' trainers hold it so).
        assert set(mla_source_dtypes(shape)) == {n for n in actual if ROUTER_BIAS in n}
    else:
        assert hf_parameter_shapes(shape, moe_layout="fused") == actual
        assert shape.router_bias and shape.router_dtype == "float32"
        assert shape.qkv_bias == bool(config.attention_bias)
        assert shape.qk_norm == bool(config.use_qk_norm)


def _mla_tiny(**kw: Any) -> MlaShape:
    return dataclasses.replace(mla_from_hf_config({**_TINY_DSV3, "topk_method": "noaux_tc"}), **kw)


def _glm_tiny() -> ModelShape:
    return dense_from_hf_config({**_TINY_GLM, "model_type": "glm4_moe"})


@pytest.mark.parametrize(
    "shape",
    [_mla_tiny(), _mla_tiny(q_lora_rank=0), _mla_tiny(num_shared_experts=0), _glm_tiny()],
    ids=["mla", "mla-no-q-lora", "mla-no-shared", "glm"],
)
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("moe_layout", ["per_expert", "fused"])
def test_every_element_reaches_the_engine(
    shape: MlaShape | ModelShape, tp_size: int, moe_layout: str
) -> None:
    """Recipes read existing trainer tensors inside their bounds; over the ranks every element
    arrives once (replicated tensors: once per rank; kv heads as replicated by vLLM)."""
    if isinstance(shape, MlaShape):
        hf = mla_parameter_shapes(shape, moe_layout=moe_layout)  # type: ignore[arg-type]
    else:
        hf = hf_parameter_shapes(shape, moe_layout=moe_layout)  # type: ignore[arg-type]
    received = dict.fromkeys(hf, 0)
    for rank in range(tp_size):
        layout = vllm_layout(shape, rank, tp_size, hf_moe_layout=moe_layout)  # type: ignore[arg-type]
        for recipe in layout.recipes:
            recipe_shape(recipe)
            for part in recipe.parts:
                assert part.source in hf, f"{recipe.dest} reads unknown {part.source}"
                assert box_in(part.source_box, full_box(hf[part.source]))
                received[part.source] += math.prod(b - a for a, b in part.source_box)
    replicated = (
        "layernorm.weight",
        "norm.weight",
        "mlp.gate.weight",
        ROUTER_BIAS,
        "kv_a_proj_with_mqa.weight",
        "q_a_proj.weight",
        "_norm.weight",
        "q_norm.weight",
        "k_norm.weight",
    )
    for src, dims in hf.items():
        n = math.prod(dims)
        if src.endswith(replicated):
            assert received[src] == n * tp_size, src
        elif isinstance(shape, ModelShape) and src.endswith(
            ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")
        ):
            assert received[src] == n * max(1, tp_size // shape.num_kv_heads), src
        else:
            assert received[src] == n, src


@pytest.mark.parametrize("moe_layout", ["per_expert", "fused"])
def test_expert_parallel_ranks_hold_whole_experts(moe_layout: str) -> None:
    shape = _mla_tiny()
    hf = mla_parameter_shapes(shape, moe_layout=moe_layout)  # type: ignore[arg-type]
    got: dict[str, int] = {}
    for ep_rank in range(2):
        for r in mla_recipes(
            shape,
            tp_rank=0,
            tp_size=1,
            ep_rank=ep_rank,
            ep_size=2,
            fp8=False,
            hf_moe_layout=moe_layout,  # type: ignore[arg-type]
        ):
            if "routed_experts" in r.dest:
                assert recipe_shape(r)[0] == 2, r.dest
                for part in r.parts:
                    got[part.source] = got.get(part.source, 0) + math.prod(
                        b - a for a, b in part.source_box
                    )
    for name, n in got.items():
        assert n == math.prod(hf[name]), name  # every expert once over the two ranks


def test_real_configs_give_the_named_presets() -> None:
    """The simulator's Kimi-K2 and DeepSeek-V3 presets are the shapes of the real configs,
    whose names and shapes tests/integration/test_vllm_mla.py checks against vLLM's model."""
    assert from_hf_config(KIMI_K2_CONFIG) == MLA_SHAPES["kimi-k2"]
    assert from_hf_config(DEEPSEEK_V3_CONFIG) == MLA_SHAPES["deepseek-v3"]
    # The MTP layer is not part of the shape (vLLM's target model skips it).
    assert MLA_SHAPES["deepseek-v3"].num_layers == 61
    # Moonlight / V2-Lite style: no query compression.
    moon = from_hf_config({**KIMI_K2_CONFIG, "q_lora_rank": None})
    assert isinstance(moon, MlaShape) and moon.q_lora_rank == 0
    specs = {s.name: s for s in vllm_layout(moon, 0, 8).specs("bfloat16")}
    a = "model.layers.3.self_attn."
    assert specs[a + "q_proj.weight"].shape == (8 * 192, 7168)
    assert specs[a + "kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert a + "fused_qkv_a_proj.weight" not in specs
    p = f"model.layers.3.{DEFAULT_MOE_PREFIX}."
    assert specs[p + "w13_weight"].shape == (384, 2 * 2048 // 8, 7168)
    assert specs["model.layers.3." + ROUTER_BIAS].dtype == "float32"


def test_mla_config_errors() -> None:
    with pytest.raises(ValueError, match=r"lacks required keys \['kv_lora_rank'\]"):
        mla_from_hf_config({k: v for k, v in KIMI_K2_CONFIG.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        from_hf_config({**KIMI_K2_CONFIG, "moe_layer_freq": 2})
    with pytest.raises(ValueError, match="ties the embeddings"):
        from_hf_config({**KIMI_K2_CONFIG, "tie_word_embeddings": True})
    with pytest.raises(ConfigurationError, match="heads do not split over tp_size 3"):
        vllm_layout(MLA_SHAPES["kimi-k2"], 0, 3)
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        from_hf_config({**_TINY_GLM, "model_type": "glm4_moe", "moe_layer_freq": 2})
    with pytest.raises(ValueError, match="not both"):
        dataclasses.replace(_glm_tiny(), shared_expert_intermediate_size=64)


def test_engine_dtypes() -> None:
    """Float32 tensors in a bf16 engine: the router biases; GLM's routers too (vLLM's
    Glm4MoE builds its GateLinear in float32)."""
    glm = {s.name: s.dtype for s in vllm_layout(_glm_tiny(), 0, 2).specs("bfloat16")}
    for i in (1, 2):
        assert glm[f"model.layers.{i}.{ROUTER_BIAS}"] == "float32"
        assert glm[f"model.layers.{i}.mlp.gate.weight"] == "float32"
    assert f"model.layers.0.{ROUTER_BIAS}" not in glm  # the first layer is dense
    assert glm["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == "bfloat16"
    mla = {s.name: s.dtype for s in vllm_layout(_mla_tiny(), 0, 2).specs("bfloat16")}
    assert mla[f"model.layers.1.{ROUTER_BIAS}"] == "float32"
    assert mla["model.layers.1.mlp.gate.weight"] == "bfloat16"
    # FP8: the linear weights quantized, router, bias and norms not.
    fp8 = {s.name: s.dtype for s in vllm_layout(_mla_tiny(), 0, 2, fp8=True).specs("bfloat16")}
    assert fp8["model.layers.1.self_attn.kv_b_proj.weight"] == "float8_e4m3fn"
    assert fp8["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"] == "float32"
    assert fp8[f"model.layers.1.{ROUTER_BIAS}"] == "float32"
    assert fp8["model.layers.1.mlp.gate.weight"] == "bfloat16"


def test_an_mtp_layer_in_the_trainer_fails_the_plan_naming_it() -> None:
    """A trainer that holds DeepSeek-V3's MTP layer (``model.layers.{num_layers}``) is refused
    before any byte moves: vLLM's model has no such layer, no recipe reads it."""
    from weight_transfer.planner.types import (
        DestManifest,
        DestRegion,
        DestTensor,
        SourceManifest,
        SourceTensor,
        dtype_size,
        numel,
    )

    shape = _mla_tiny()
    hf = mla_parameter_shapes(shape)
    mtp = f"model.layers.{shape.num_layers}.eh_proj.weight"
    hf[mtp] = (shape.hidden_size, 2 * shape.hidden_size)
    dtypes = mla_source_dtypes(shape)
    sources = [
        SourceManifest(
            rank=0,
            world_size=1,
            host="h",
            tensors=tuple(
                SourceTensor(n, s, dtypes.get(n, "bfloat16"), full_box(s), (0,), "cpu")
                for n, s in sorted(hf.items())
            ),
        )
    ]
    layout = vllm_layout(shape, 0, 1)
    tensors, off = [], 0
    for s in layout.specs("bfloat16"):
        tensors.append(DestTensor(s.name, s.shape, s.dtype, 0, off))
        off += numel(s.shape) * dtype_size(s.dtype)
    dest = DestManifest(
        engine="e0",
        host="h",
        regions=(DestRegion(0, off, b"r0"), DestRegion(1, 8, b"v")),
        tensors=tuple(tensors),
        recipes=layout.recipes,
        version_region=1,
    )
    with pytest.raises(PlanMismatchError, match=f"{mtp}.*read by no engine recipe"):
        plan(sources, [dest])
    del hf[mtp]
    plan(
        [
            dataclasses.replace(
                sources[0], tensors=tuple(t for t in sources[0].tensors if t.name != mtp)
            )
        ],
        [dest],
    )


def test_trainer_sources_are_the_checkpoints_tensors() -> None:
    """What `WeightSender` reads from a module: its parameters and persistent buffers (the
    router biases), exactly the keys of its state_dict; the rotary tables (non-persistent
    buffers) are not weights. The receiver side keeps parameters only."""
    import torch
    import transformers

    from weight_transfer.manifest import named_tensors

    config = transformers.DeepseekV3Config(**_TINY_DSV3)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    sources = named_tensors(model, persistent_buffers=True)
    assert set(sources) == set(model.state_dict())
    assert {n for n in sources if ROUTER_BIAS in n} == {
        f"model.layers.{i}.{ROUTER_BIAS}" for i in (1, 2)
    }
    assert any("inv_freq" in n for n, _ in model.named_buffers())
    assert not any("inv_freq" in n for n in sources)
    assert set(named_tensors(model)) == {n for n, _ in model.named_parameters()}
