"""Model shapes: the dimensions of a Llama/Qwen-style decoder and its trainer-side parameters.

A `ModelShape` is all the planner and the presets need to know about a model: no weights, no
code. `hf_parameter_shapes` lists the parameters a Hugging Face trainer holds for that shape
(names and global shapes), which is what trainer manifests and benchmarks are built from.
MLA models (DeepSeek-V2/V3, Kimi-K2, Moonlight) have their own shape,
`planner.presets.deepseek.MlaShape`; `from_hf_config` returns whichever describes the config.

Naming follows the HF Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / GLM-4.5-MoE models. MoE
experts come in two trainer layouts:

* ``"per_expert"`` (HF checkpoints, transformers < 5):
``mlp.experts.{e}.{gate,up,down}_proj.weight``
  of shapes ``[I, H]``, ``[I, H]``, ``[H, I]``.
* ``"fused"`` (transformers >= 5 modules): ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` (gate
  rows first, up rows second, per expert) and ``mlp.experts.down_proj`` ``[E, H, I]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from weight_transfer.planner.presets.deepseek import MlaShape

MoeLayout = Literal["per_expert", "fused"]
"""How a trainer holds MoE expert weights (see the module docstring)."""

MOE_LAYOUTS: tuple[str, ...] = ("per_expert", "fused")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """Dimensions of a decoder-only transformer (Llama/Qwen/GLM family).

    When `num_experts` > 0 the MLP of every layer from `first_k_dense` on is a mixture of
    experts (the first `first_k_dense` layers are dense, GLM-4.5 style), with an optional shared
    expert: Qwen2-MoE style (``mlp.shared_expert`` and its ``mlp.shared_expert_gate``) when
    `shared_expert_intermediate_size` > 0, or DeepSeek/GLM style (``mlp.shared_experts`` of
    width ``num_shared_experts * moe_intermediate_size``, no gate) when `num_shared_experts` > 0.
    """

    vocab_size: int
    """Rows of the embedding and of lm_head."""
    hidden_size: int
    """Model width H."""
    intermediate_size: int
    """Width of the dense MLP (unused by MoE layers)."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA: divides `num_heads`)."""
    head_dim: int
    """Width of one attention head."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding's weight (no lm_head parameter)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    moe_intermediate_size: int = 0
    """Width I of one routed expert's MLP."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert's MLP (Qwen2-MoE); 0 for none."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2); o_proj never does."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3): `self_attn.{q,k}_norm.weight` [head_dim]."""
    first_k_dense: int = 0
    """Leading layers with a dense MLP in a MoE model (GLM-4.5 `first_k_dense_replace`)."""
    num_shared_experts: int = 0
    """DeepSeek/GLM-style shared experts (``mlp.shared_experts``, no gate); 0 for none."""
    router_bias: bool = False
    """MoE layers have ``mlp.gate.e_score_correction_bias [E]`` (float32; ``noaux_tc`` routing)."""
    router_dtype: str | None = None
    """Engine dtype of the router ``mlp.gate.weight`` where vLLM does not hold it in the model's
    dtype (vLLM's GLM-4.5-MoE builds it in float32); None: the model's dtype."""

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")
        for name in (
            "intermediate_size",
            "num_experts",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "first_k_dense",
            "num_shared_experts",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelShape.{name} must be a non-negative int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (GQA groups must be whole)"
            )
        if self.num_experts > 0 and self.moe_intermediate_size <= 0:
            raise ValueError(
                f"ModelShape: num_experts={self.num_experts} needs moe_intermediate_size > 0"
            )
        if self.num_experts == 0 and self.intermediate_size <= 0:
            raise ValueError("ModelShape: a dense model needs intermediate_size > 0")
        if self.num_experts == 0 and (
            self.shared_expert_intermediate_size
            or self.num_shared_experts
            or self.first_k_dense
            or self.router_bias
        ):
            raise ValueError(
                "ModelShape: shared experts, first_k_dense and router_bias need num_experts > 0"
            )
        if self.shared_expert_intermediate_size and self.num_shared_experts:
            raise ValueError(
                "ModelShape: set shared_expert_intermediate_size (Qwen2-MoE style) or "
                "num_shared_experts (DeepSeek/GLM style), not both"
            )
        if self.first_k_dense and self.intermediate_size <= 0:
            raise ValueError("ModelShape: first_k_dense dense layers need intermediate_size > 0")
        if self.first_k_dense > self.num_layers:
            raise ValueError("ModelShape: first_k_dense exceeds num_layers")
        if self.router_dtype is not None and self.router_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ModelShape.router_dtype {self.router_dtype!r} is not supported")

    @property
    def is_moe(self) -> bool:
        """True when the MLPs are mixtures of experts."""
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """True for layers whose MLP is a mixture of experts."""
        return self.is_moe and layer >= self.first_k_dense

    @property
    def q_size(self) -> int:
        """Rows of q_proj (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj and of v_proj (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
"""HF `model_type`s of MLA models (described by `planner.presets.deepseek.MlaShape`)."""


def from_hf_config(cfg: Any) -> ModelShape | MlaShape:
    """Build the shape of a transformers config object or its dict (``config.json``).

    Understands Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and GLM-4.5-MoE configs (and
    others with the same keys), which give a `ModelShape`, and the MLA models (`MLA_MODEL_TYPES`:
    DeepSeek-V2/V3, Kimi-K2, Moonlight), which give a `planner.presets.deepseek.MlaShape`
    (`planner.presets.deepseek.mla_from_hf_config`). Missing `tie_word_embeddings` reads as
    False; missing `head_dim` as hidden_size // num_attention_heads; missing
    `num_key_value_heads` as num_attention_heads. A multi-token-prediction layer
    (`num_nextn_predict_layers`) is not part of the shape: vLLM's model does not hold it (only
    a speculative-decoding draft model does).

    Raises:
        ValueError: a required key is missing, or the config describes something the shape
            cannot (dense layers interleaved with MoE layers, an o_proj bias).
    """
    if str(_get(cfg, "model_type", "")) in MLA_MODEL_TYPES:
        from weight_transfer.planner.presets.deepseek import mla_from_hf_config

        return mla_from_hf_config(cfg)
    return dense_from_hf_config(cfg)


def dense_from_hf_config(cfg: Any) -> ModelShape:
    """`from_hf_config` for the non-MLA families (always a `ModelShape`).

    Raises:
        ValueError: as `from_hf_config`.
    """
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if _get(cfg, k) is None]
    if missing:
        raise ValueError(f"HF config lacks required keys {missing}")
    model_type = str(_get(cfg, "model_type", ""))
    what = model_type or "unknown model_type"
    num_heads = int(_get(cfg, "num_attention_heads"))
    hidden = int(_get(cfg, "hidden_size"))
    num_experts = int(
        _get(cfg, "num_experts", 0)
        or _get(cfg, "num_local_experts", 0)
        or _get(cfg, "n_routed_experts", 0)
    )
    first_dense = int(_get(cfg, "first_k_dense_replace", 0)) if num_experts else 0
    if num_experts:
        mlp_only = list(_get(cfg, "mlp_only_layers", []) or [])
        step = int(_get(cfg, "decoder_sparse_step", 1))
        freq = int(_get(cfg, "moe_layer_freq", 1))
        if mlp_only or step != 1 or freq != 1:
            raise ValueError(
                f"HF config ({what}) interleaves dense and MoE layers "
                f"(mlp_only_layers={mlp_only}, decoder_sparse_step={step}, "
                f"moe_layer_freq={freq}); ModelShape supports MoE models whose dense layers, if "
                "any, come first (first_k_dense_replace)"
            )
    glm = model_type == "glm4_moe"
    attention_bias = bool(_get(cfg, "attention_bias", False))
    if attention_bias and not glm:
        raise ValueError(
            f"HF config ({what}) has attention_bias=True (an o_proj bias); ModelShape supports "
            "q/k/v biases only (Qwen2 style; GLM-4.5's attention_bias is q/k/v only)"
        )
    shared = int(_get(cfg, "n_shared_experts", 0)) if num_experts else 0
    return ModelShape(
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_get(cfg, "intermediate_size", 0)),
        num_layers=int(_get(cfg, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", num_heads)),
        head_dim=int(_get(cfg, "head_dim", hidden // num_heads)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        num_experts=num_experts,
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", 0)) if num_experts else 0,
        shared_expert_intermediate_size=(
            int(_get(cfg, "shared_expert_intermediate_size", 0)) if num_experts else 0
        ),
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or (glm and attention_bias),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or (glm and bool(_get(cfg, "use_qk_norm"))),
        first_k_dense=first_dense,
        num_shared_experts=shared,
        # GLM-4.5-MoE always routes with the bias (vLLM's Glm4MoE and transformers both hold it).
        router_bias=glm and num_experts > 0,
        router_dtype="float32" if glm and num_experts else None,
    )


def hf_parameter_shapes(
    shape: ModelShape, *, moe_layout: MoeLayout = "per_expert"
) -> dict[str, tuple[int, ...]]:
    """Trainer-side (HF) parameter names and global shapes, in module order.

    Args:
        shape: the model.
        moe_layout: how experts are held (``"per_expert"`` or ``"fused"``; module docstring).

    Raises:
        ValueError: unknown `moe_layout`.
    """
    if moe_layout not in MOE_LAYOUTS:
        raise ValueError(f"moe_layout must be one of {MOE_LAYOUTS}, got {moe_layout!r}")
    h = shape.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (shape.q_size, h)
        out[p + "self_attn.k_proj.weight"] = (shape.kv_size, h)
        out[p + "self_attn.v_proj.weight"] = (shape.kv_size, h)
        if shape.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (shape.q_size,)
            out[p + "self_attn.k_proj.bias"] = (shape.kv_size,)
            out[p + "self_attn.v_proj.bias"] = (shape.kv_size,)
        out[p + "self_attn.o_proj.weight"] = (h, shape.q_size)
        if shape.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (shape.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (shape.head_dim,)
        if shape.is_moe_layer(i):
            e, i_moe = shape.num_experts, shape.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (e, h)
            if shape.router_bias:
                out[p + "mlp.gate.e_score_correction_bias"] = (e,)
            if moe_layout == "fused":
                out[p + "mlp.experts.gate_up_proj"] = (e, 2 * i_moe, h)
                out[p + "mlp.experts.down_proj"] = (e, h, i_moe)
            else:
                for x in range(e):
                    out[p + f"mlp.experts.{x}.gate_proj.weight"] = (i_moe, h)
                    out[p + f"mlp.experts.{x}.up_proj.weight"] = (i_moe, h)
                    out[p + f"mlp.experts.{x}.down_proj.weight"] = (h, i_moe)
            if shape.shared_expert_intermediate_size:
                i_sh = shape.shared_expert_intermediate_size
                out[p + "mlp.shared_expert.gate_proj.weight"] = (i_sh, h)
                out[p + "mlp.shared_expert.up_proj.weight"] = (i_sh, h)
                out[p + "mlp.shared_expert.down_proj.weight"] = (h, i_sh)
                out[p + "mlp.shared_expert_gate.weight"] = (1, h)
            if shape.num_shared_experts:
                i_sh = shape.num_shared_experts * i_moe
                out[p + "mlp.shared_experts.gate_proj.weight"] = (i_sh, h)
                out[p + "mlp.shared_experts.up_proj.weight"] = (i_sh, h)
                out[p + "mlp.shared_experts.down_proj.weight"] = (h, i_sh)
        else:
            i_d = shape.intermediate_size
            out[p + "mlp.gate_proj.weight"] = (i_d, h)
            out[p + "mlp.up_proj.weight"] = (i_d, h)
            out[p + "mlp.down_proj.weight"] = (h, i_d)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


def num_parameters(shape: ModelShape) -> int:
    """Number of trainer-side parameters (elements) of the model."""
    total = 0
    for dims in hf_parameter_shapes(shape).values():
        n = 1
        for d in dims:
            n *= d
        total += n
    return total


MODEL_SHAPES: dict[str, ModelShape] = {
    # Tests and the demo; equals the oracle's cfg_a. No size is a multiple of 128 except H.
    "tiny": ModelShape(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=704,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
    ),
    # Tests and the demo; its MoE layers equal the oracle's cfg_moe.
    "tiny-moe": ModelShape(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=704,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        num_experts=4,
        moe_intermediate_size=384,
    ),
    # meta-llama/Llama-3.1-8B config.json.
    "llama-3.1-8b": ModelShape(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
    ),
    # Qwen/Qwen3-30B-A3B config.json (every layer MoE: decoder_sparse_step 1, no mlp_only_layers).
    "qwen3-30b-a3b": ModelShape(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        moe_intermediate_size=768,
        qk_norm=True,
    ),
}
"""Named model shapes (presets)."""


def get_model_shape(name: str) -> ModelShape:
    """The named preset shape.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}"
        ) from None
