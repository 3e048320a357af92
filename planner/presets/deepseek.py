"""DeepSeek-V3 / Kimi-K2 model shapes (MLA attention, shared and routed experts) and their recipes.

The shapes list every trainer (HF) parameter, and the recipes build one vLLM engine rank's
parameters the way vLLM 0.32's ``deepseek_v2.py`` model (`DeepseekV3ForCausalLM`, also
DeepSeek-V2 and Kimi-K2) holds them: names, shapes and dtypes are checked against a live vLLM
model in ``tests/integration/test_vllm_mla.py``, and the plug-in uses these recipes for a
running engine, so the planner's and simulator's Kimi-K2 and DeepSeek-V3 presets describe the
model vLLM runs. The conventions:

* Trainer (HF checkpoint names), per layer ``model.layers.{i}.``:
  ``self_attn.q_a_proj.weight [q_lora, H]``, ``self_attn.q_a_layernorm.weight [q_lora]``,
  ``self_attn.q_b_proj.weight [heads * (nope + rope), q_lora]`` (without query compression,
  ``q_lora_rank = 0``, as DeepSeek-V2-Lite and Moonlight: ``self_attn.q_proj.weight
  [heads * (nope + rope), H]`` instead of those three),
  ``self_attn.kv_a_proj_with_mqa.weight [kv_lora + rope, H]``,
  ``self_attn.kv_a_layernorm.weight [kv_lora]``,
  ``self_attn.kv_b_proj.weight [heads * (nope + v), kv_lora]``,
  ``self_attn.o_proj.weight [H, heads * v]``, the two layer norms; the first
  `first_k_dense` layers have a dense ``mlp.{gate,up,down}_proj``; the others have a router
  ``mlp.gate.weight [E, H]`` with ``mlp.gate.e_score_correction_bias [E]`` (float32, a
  persistent buffer in transformers; ``noaux_tc`` routing),
  ``mlp.shared_experts.{gate,up,down}_proj`` and ``mlp.experts.{e}.{gate,up,down}_proj``
  (transformers >= 5 holds the experts stacked: ``mlp.experts.gate_up_proj [E, 2 * I, H]``,
  ``mlp.experts.down_proj [E, H, I]``, the ``"fused"`` layout).
* Engine (vLLM): ``self_attn.fused_qkv_a_proj.weight`` = ``[q_a_proj | kv_a_proj_with_mqa]``
  replicated on every rank (vLLM builds it with ``disable_tp``; without query compression
  ``kv_a_proj_with_mqa`` stays alone, replicated, and ``q_proj`` is column-parallel);
  ``q_b_proj`` and ``kv_b_proj`` column-parallel (split by heads), ``o_proj`` row-parallel;
  layer norms, the router and its bias replicated; dense MLP and shared experts as
  ``gate_up_proj``/``down_proj`` column/row parallel; routed experts stacked into
  ``mlp.experts.routed_experts.w13_weight [E_local, 2 * I, H]`` and ``...w2_weight
  [E_local, H, I]``. With expert parallelism (``ep > 1``) rank k of a replica holds the whole
  experts ``[k * E / ep, (k + 1) * E / ep)`` (vLLM's linear placement); without it every rank
  holds every expert's tensor-parallel slice. The embedding and lm_head follow vLLM's padded
  vocabulary (`planner.presets.vllm.vocab_rows`).
* Attention and dense layers are tensor parallel over `tp` ranks; with ``ep > tp`` a replica
  runs ``ep / tp`` data-parallel attention groups (vLLM's DP attention + EP), each holding its
  own copy of the attention and dense weights.
* FP8 (``fp8=True``): every linear weight above (not the router, embeddings or lm_head) is
  block-quantized 128x128 in the engine rank's layout, with a ``..._scale_inv`` tensor.

Derived, not written: after loading, vLLM's ``MLAAttention`` derives ``mla_attn.mla_attn.W_UK_T
[heads_r, nope, kv_lora]`` and ``W_UV [heads_r, kv_lora, v]`` from ``kv_b_proj`` (dequantized
when FP8); no recipe writes them, and the vLLM plug-in re-runs vLLM's own derivation after each
update (on the CPU backend they are views of ``kv_b_proj``'s weight, on GPUs computed copies of
``kv_b_proj``'s size). The simulator counts the bytes written, not that engine-side work.

The multi-token-prediction layer (``num_nextn_predict_layers``; layer 61 of the DeepSeek-V3
checkpoints) is not part of the shape: vLLM's `DeepseekV3ForCausalLM` skips it when loading and
only a speculative-decoding draft model (``DeepSeekMTP``) holds it. A trainer tensor of that
layer is read by no recipe and fails the plan as an extra tensor; the vLLM plug-in refuses an
engine with a draft model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from weight_transfer.errors import ConfigurationError
from weight_transfer.planner.presets.models import MOE_LAYOUTS, MoeLayout
from weight_transfer.planner.presets.vllm import DEFAULT_MOE_PREFIX, ROUTER_BIAS, vocab_rows
from weight_transfer.planner.recipes import (
    column_shard,
    concat_rows,
    even_bounds,
    fused_gate_up,
    identity,
    moe_w2,
    moe_w2_fused,
    moe_w13,
    moe_w13_fused,
    row_shard,
    split_bounds,
    with_fp8,
)
from weight_transfer.planner.types import Range, Recipe


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaShape:
    """Dimensions of a DeepSeek-V3-style model: MLA attention, first dense layers, MoE after."""

    vocab_size: int
    """Rows of the embedding and of lm_head."""
    hidden_size: int
    """Model width H."""
    intermediate_size: int
    """Width of the dense MLP of the first `first_k_dense` layers."""
    num_layers: int
    """Decoder layers (without the multi-token-prediction layer)."""
    num_heads: int
    """Attention heads."""
    q_lora_rank: int
    """Rank of the query down-projection (q_a_proj rows); 0: no query compression (``q_proj``,
    as DeepSeek-V2-Lite and Moonlight)."""
    kv_lora_rank: int
    """Rank of the compressed kv (kv_a_proj rows without the rope part)."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head rotary width (shared key rope rows in kv_a_proj_with_mqa)."""
    v_head_dim: int
    """Per-head value width."""
    num_experts: int
    """Routed experts per MoE layer."""
    moe_intermediate_size: int
    """Width I of one routed expert."""
    num_shared_experts: int = 1
    """Shared experts per MoE layer (fused into one MLP of width num_shared * I)."""
    first_k_dense: int = 1
    """Leading layers with a dense MLP instead of experts."""
    router_bias: bool = True
    """MoE layers have ``mlp.gate.e_score_correction_bias`` (``topk_method: noaux_tc``, as
    DeepSeek-V3 and Kimi-K2; DeepSeek-V2 routes without it)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "router_bias":
                if not isinstance(value, bool):
                    raise ValueError(f"MlaShape.router_bias must be a bool, got {value!r}")
                continue
            low = 0 if f.name in ("num_shared_experts", "first_k_dense", "q_lora_rank") else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"MlaShape.{f.name} must be an int >= {low}, got {value!r}")
        if self.first_k_dense > self.num_layers:
            raise ValueError("MlaShape: first_k_dense exceeds num_layers")

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the fused shared-expert MLP."""
        return self.num_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """True for layers whose MLP is a mixture of experts."""
        return layer >= self.first_k_dense


MLA_SHAPES: dict[str, MlaShape] = {
    # moonshotai/Kimi-K2-Instruct config.json (1.04T parameters).
    "kimi-k2": MlaShape(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=384,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        first_k_dense=1,
    ),
    # deepseek-ai/DeepSeek-V3 config.json (671B parameters).
    "deepseek-v3": MlaShape(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        first_k_dense=3,
    ),
}
"""Named MLA model shapes."""


def expert_param(layer: int, expert: int, which: str) -> str:
    """HF name of routed expert `expert`'s `which` ("gate", "up", "down") projection."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{which}_proj.weight"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)
    return default if value is None else value


def mla_from_hf_config(cfg: Any) -> MlaShape:
    """The `MlaShape` of a DeepSeek-V2/V3, Kimi-K2 or Moonlight transformers config (or dict).

    ``q_lora_rank: null`` reads as 0 (no query compression); ``n_shared_experts: null`` as 0;
    ``topk_method: noaux_tc`` means a router bias (real V3 / Kimi-K2 configs carry it;
    transformers' `DeepseekV3Config` does not save it, and vLLM then builds no bias and fails to
    load the checkpoint's). `num_nextn_predict_layers` (the MTP layer) is not part of the shape
    (module docstring).

    Raises:
        ValueError: a required key is missing, or the config describes what vLLM's model or this
            shape does not (no routed experts, MoE layers interleaved with dense ones, tied
            embeddings).
    """
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "moe_intermediate_size",
    )
    missing = [k for k in required if _get(cfg, k) is None]
    what = str(_get(cfg, "model_type", "MLA"))
    if missing:
        raise ValueError(f"HF config ({what}) lacks required keys {missing}")
    freq = int(_get(cfg, "moe_layer_freq", 1))
    if freq != 1:
        raise ValueError(
            f"HF config ({what}) has moe_layer_freq={freq} (MoE layers interleaved with dense "
            "ones); MlaShape supports dense layers first (first_k_dense_replace) only"
        )
    if bool(_get(cfg, "tie_word_embeddings", False)):
        raise ValueError(f"HF config ({what}) ties the embeddings; MlaShape has an lm_head")
    return MlaShape(
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=int(_get(cfg, "hidden_size")),
        intermediate_size=int(_get(cfg, "intermediate_size")),
        num_layers=int(_get(cfg, "num_hidden_layers")),
        num_heads=int(_get(cfg, "num_attention_heads")),
        q_lora_rank=int(_get(cfg, "q_lora_rank", 0)),
        kv_lora_rank=int(_get(cfg, "kv_lora_rank")),
        qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim")),
        v_head_dim=int(_get(cfg, "v_head_dim")),
        num_experts=int(_get(cfg, "n_routed_experts")),
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size")),
        num_shared_experts=int(_get(cfg, "n_shared_experts", 0)),
        first_k_dense=int(_get(cfg, "first_k_dense_replace", 0)),
        router_bias=_get(cfg, "topk_method") == "noaux_tc",
    )


def mla_parameter_shapes(
    shape: MlaShape, *, moe_layout: MoeLayout = "per_expert"
) -> dict[str, tuple[int, ...]]:
    """Trainer-side (HF) tensor names and global shapes, in module order (the router bias is a
    persistent buffer in transformers, a tensor of the checkpoint all the same).

    Raises:
        ValueError: unknown `moe_layout`.
    """
    if moe_layout not in MOE_LAYOUTS:
        raise ValueError(f"moe_layout must be one of {MOE_LAYOUTS}, got {moe_layout!r}")
    h = shape.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        q_rows = shape.num_heads * shape.qk_head_dim
        if shape.q_lora_rank:
            out[a + "q_a_proj.weight"] = (shape.q_lora_rank, h)
            out[a + "q_a_layernorm.weight"] = (shape.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (q_rows, shape.q_lora_rank)
        else:
            out[a + "q_proj.weight"] = (q_rows, h)
        out[a + "kv_a_proj_with_mqa.weight"] = (shape.kv_lora_rank + shape.qk_rope_head_dim, h)
        out[a + "kv_a_layernorm.weight"] = (shape.kv_lora_rank,)
        out[a + "kv_b_proj.weight"] = (
            shape.num_heads * (shape.qk_nope_head_dim + shape.v_head_dim),
            shape.kv_lora_rank,
        )
        out[a + "o_proj.weight"] = (h, shape.num_heads * shape.v_head_dim)
        if shape.is_moe_layer(i):
            e, inter = shape.num_experts, shape.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (e, h)
            if shape.router_bias:
                out[p + ROUTER_BIAS] = (e,)
            sh = shape.shared_intermediate_size
            if sh:
                out[p + "mlp.shared_experts.gate_proj.weight"] = (sh, h)
                out[p + "mlp.shared_experts.up_proj.weight"] = (sh, h)
                out[p + "mlp.shared_experts.down_proj.weight"] = (h, sh)
            if moe_layout == "fused":
                out[p + "mlp.experts.gate_up_proj"] = (e, 2 * inter, h)
                out[p + "mlp.experts.down_proj"] = (e, h, inter)
            else:
                for x in range(e):
                    out[expert_param(i, x, "gate")] = (inter, h)
                    out[expert_param(i, x, "up")] = (inter, h)
                    out[expert_param(i, x, "down")] = (h, inter)
        else:
            out[p + "mlp.gate_proj.weight"] = (shape.intermediate_size, h)
            out[p + "mlp.up_proj.weight"] = (shape.intermediate_size, h)
            out[p + "mlp.down_proj.weight"] = (h, shape.intermediate_size)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (shape.vocab_size, h)
    return out


def mla_source_dtypes(shape: MlaShape, param_dtype: str = "bfloat16") -> dict[str, str]:
    """Trainer dtypes of the tensors that are not `param_dtype` (the float32 router biases)."""
    if not shape.router_bias:
        return {}
    return {
        f"model.layers.{i}.{ROUTER_BIAS}": "float32"
        for i in range(shape.num_layers)
        if shape.is_moe_layer(i)
    }


def local_experts(num_experts: int, ep_rank: int, ep_size: int) -> Range:
    """Experts ``[start, stop)`` that expert-parallel rank `ep_rank` holds (linear placement).

    Raises:
        ConfigurationError: the experts do not divide by `ep_size` (vLLM requires it here).
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ConfigurationError(f"ep_rank {ep_rank} is not in [0, ep_size={ep_size})")
    if num_experts % ep_size:
        raise ConfigurationError(
            f"mlp.experts.w13_weight: {num_experts} routed experts do not divide by "
            f"expert-parallel size {ep_size}"
        )
    per = num_experts // ep_size
    return (ep_rank * per, (ep_rank + 1) * per)


def _head_bounds(num_heads: int, tp_size: int, per_head: int) -> list[Range]:
    return [(r0 * per_head, r1 * per_head) for r0, r1 in split_bounds(num_heads, tp_size)]


def mla_recipes(
    shape: MlaShape,
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
    fp8: bool = True,
    fp8_block: tuple[int, int] = (128, 128),
    moe_prefix: str = DEFAULT_MOE_PREFIX,
    hf_moe_layout: MoeLayout = "per_expert",
) -> tuple[Recipe, ...]:
    """Recipes for one vLLM engine rank of a DeepSeek-V3-style model (module docstring).

    Args:
        tp_rank, tp_size: tensor-parallel rank and size of attention and dense layers.
        ep_rank, ep_size: expert-parallel rank and size; 1 means experts are tensor parallel.
        fp8: block-quantize the linear weights.
        moe_prefix: where a layer's routed experts live in vLLM's module tree.
        hf_moe_layout: how the trainer holds experts ("per_expert" or "fused").

    Raises:
        ConfigurationError: heads, widths or experts that do not divide as vLLM requires, or a
            bad rank or layout.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigurationError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
    if hf_moe_layout not in MOE_LAYOUTS:
        raise ConfigurationError(
            f"hf_moe_layout must be one of {MOE_LAYOUTS}, got {hf_moe_layout!r}"
        )
    h = shape.hidden_size
    if shape.num_heads % tp_size:
        raise ConfigurationError(
            f"self_attn: {shape.num_heads} heads do not split over tp_size {tp_size}"
        )

    def q(recipe: Recipe) -> Recipe:
        return with_fp8(recipe, block=fp8_block) if fp8 else recipe

    def even(size: int, what: str) -> tuple[Range, ...]:
        try:
            return even_bounds(size, tp_size, what=what)
        except ValueError as exc:
            raise ConfigurationError(f"vLLM requires divisibility: {exc}") from None

    def mlp(prefix: str, src: str, inter: int) -> list[Recipe]:
        bounds = even(inter, f"{prefix}gate_up_proj.weight (intermediate {inter})")
        return [
            q(
                fused_gate_up(
                    prefix + "gate_up_proj.weight",
                    src + "gate_proj.weight",
                    src + "up_proj.weight",
                    shape=(inter, h),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    bounds=bounds,
                )
            ),
            q(
                row_shard(
                    prefix + "down_proj.weight",
                    src + "down_proj.weight",
                    (h, inter),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    bounds=bounds,
                )
            ),
        ]

    vocab_bounds = [vocab_rows(shape.vocab_size, r, tp_size) for r in range(tp_size)]
    vocab_shape = (shape.vocab_size, h)
    out: list[Recipe] = [
        column_shard(
            "model.embed_tokens.weight",
            "model.embed_tokens.weight",
            vocab_shape,
            tp_rank=tp_rank,
            tp_size=tp_size,
            bounds=vocab_bounds,
        )
    ]
    kv_a_rows = shape.kv_lora_rank + shape.qk_rope_head_dim
    qk = shape.qk_head_dim
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if shape.q_lora_rank:
            out.append(
                q(
                    concat_rows(
                        a + "fused_qkv_a_proj.weight",
                        [
                            (a + "q_a_proj.weight", (shape.q_lora_rank, h), (0, shape.q_lora_rank)),
                            (a + "kv_a_proj_with_mqa.weight", (kv_a_rows, h), (0, kv_a_rows)),
                        ],
                    )
                )
            )
            out.append(
                identity(
                    a + "q_a_layernorm.weight", a + "q_a_layernorm.weight", (shape.q_lora_rank,)
                )
            )
            q_in, q_name = shape.q_lora_rank, "q_b_proj.weight"
        else:
            kv_a = a + "kv_a_proj_with_mqa.weight"
            out.append(q(identity(kv_a, kv_a, (kv_a_rows, h))))
            q_in, q_name = h, "q_proj.weight"
        out.append(
            q(
                column_shard(
                    a + q_name,
                    a + q_name,
                    (shape.num_heads * qk, q_in),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    bounds=_head_bounds(shape.num_heads, tp_size, qk),
                )
            )
        )
        out.append(
            identity(
                a + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", (shape.kv_lora_rank,)
            )
        )
        kvh = shape.qk_nope_head_dim + shape.v_head_dim
        out.append(
            q(
                column_shard(
                    a + "kv_b_proj.weight",
                    a + "kv_b_proj.weight",
                    (shape.num_heads * kvh, shape.kv_lora_rank),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    bounds=_head_bounds(shape.num_heads, tp_size, kvh),
                )
            )
        )
        vd = shape.v_head_dim
        out.append(
            q(
                row_shard(
                    a + "o_proj.weight",
                    a + "o_proj.weight",
                    (h, shape.num_heads * vd),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    bounds=_head_bounds(shape.num_heads, tp_size, vd),
                )
            )
        )
        if shape.is_moe_layer(i):
            out.extend(
                _moe(
                    shape,
                    i,
                    q,
                    even,
                    mlp,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    ep_rank=ep_rank,
                    ep_size=ep_size,
                    moe_prefix=moe_prefix,
                    hf_moe_layout=hf_moe_layout,
                )
            )
        else:
            out.extend(mlp(p + "mlp.", p + "mlp.", shape.intermediate_size))
        out.append(identity(p + "input_layernorm.weight", p + "input_layernorm.weight", (h,)))
        out.append(
            identity(
                p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (h,)
            )
        )
    out.append(identity("model.norm.weight", "model.norm.weight", (h,)))
    out.append(
        column_shard(
            "lm_head.weight",
            "lm_head.weight",
            vocab_shape,
            tp_rank=tp_rank,
            tp_size=tp_size,
            bounds=vocab_bounds,
        )
    )
    return tuple(out)


def _moe(
    shape: MlaShape,
    i: int,
    q: Callable[[Recipe], Recipe],
    even: Callable[[int, str], tuple[Range, ...]],
    mlp: Callable[[str, str, int], list[Recipe]],
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    ep_size: int,
    moe_prefix: str,
    hf_moe_layout: str,
) -> list[Recipe]:
    """A MoE layer's router (and bias), shared experts and routed experts."""
    p = f"model.layers.{i}."
    h, e, inter = shape.hidden_size, shape.num_experts, shape.moe_intermediate_size
    out: list[Recipe] = [identity(p + "mlp.gate.weight", p + "mlp.gate.weight", (e, h))]
    if shape.router_bias:
        out.append(identity(p + ROUTER_BIAS, p + ROUTER_BIAS, (e,)))
    if shape.shared_intermediate_size:
        out.extend(
            mlp(
                p + "mlp.shared_experts.", p + "mlp.shared_experts.", shape.shared_intermediate_size
            )
        )
    if ep_size > 1:
        e0, e1 = local_experts(e, ep_rank, ep_size)
        etp_rank, etp_size, ebounds = 0, 1, None
    else:
        e0, e1 = 0, e
        etp_rank, etp_size = tp_rank, tp_size
        ebounds = even(inter, f"{p}{moe_prefix}.w13_weight (moe_intermediate {inter})")
    mp = f"{p}{moe_prefix}."
    if hf_moe_layout == "fused":
        w13 = moe_w13_fused(
            mp + "w13_weight",
            p + "mlp.experts.gate_up_proj",
            num_experts=e,
            intermediate_size=inter,
            hidden_size=h,
            tp_rank=etp_rank,
            tp_size=etp_size,
            bounds=ebounds,
            experts=(e0, e1),
        )
        w2 = moe_w2_fused(
            mp + "w2_weight",
            p + "mlp.experts.down_proj",
            num_experts=e,
            hidden_size=h,
            intermediate_size=inter,
            tp_rank=etp_rank,
            tp_size=etp_size,
            bounds=ebounds,
            experts=(e0, e1),
        )
    else:
        ex = range(e0, e1)
        w13 = moe_w13(
            mp + "w13_weight",
            [expert_param(i, x, "gate") for x in ex],
            [expert_param(i, x, "up") for x in ex],
            intermediate_size=inter,
            hidden_size=h,
            tp_rank=etp_rank,
            tp_size=etp_size,
            bounds=ebounds,
        )
        w2 = moe_w2(
            mp + "w2_weight",
            [expert_param(i, x, "down") for x in ex],
            hidden_size=h,
            intermediate_size=inter,
            tp_rank=etp_rank,
            tp_size=etp_size,
            bounds=ebounds,
        )
    out.extend([q(w13), q(w2)])
    return out


def mla_engine_dtypes(shape: MlaShape) -> dict[str, str]:
    """Engine tensors that are not the parameter dtype (the float32 router biases)."""
    return mla_source_dtypes(shape)


__all__ = [
    "MLA_SHAPES",
    "MlaShape",
    "ROUTER_BIAS",
    "expert_param",
    "local_experts",
    "mla_engine_dtypes",
    "mla_from_hf_config",
    "mla_parameter_shapes",
    "mla_recipes",
    "mla_source_dtypes",
]
