"""vLLM layout preset: recipes that build one vLLM tensor-parallel rank's parameters.

Conventions are those of vLLM 0.33.0's own weight loaders, checked against
``tests/fixtures/vllm_layouts.txt`` (recorded from vLLM's loaders: `QKVParallelLinear`,
`MergedColumnParallelLinear`, `RowParallelLinear`, `FusedMoE` routed experts) for a GQA model at
tp 1/2/4/8 and a MoE layer at tp 1/2:

* ``self_attn.qkv_proj.weight`` (and ``.bias`` for Qwen2): ``[q rows of r | k rows of r |
  v rows of r]``; with tp > num_kv_heads rank r holds kv head ``r // (tp // num_kv_heads)``.
* ``self_attn.o_proj.weight``: row-parallel (dim 1 split by query heads).
* ``mlp.gate_up_proj.weight``: ``[gate rows of r | up rows of r]``; ``mlp.down_proj.weight``
  row-parallel.
* MoE: ``{moe_prefix}.w13_weight [E, 2*I/tp, H]`` (per expert gate rows then up rows) and
  ``{moe_prefix}.w2_weight [E, H, I/tp]``; the router ``mlp.gate.weight`` is replicated.
  `moe_prefix` defaults to ``mlp.experts.routed_experts`` as in the oracle. Expert
  parallelism is not modelled (every rank holds every expert's tensor-parallel slice).
* Shared expert (Qwen2-MoE): ``mlp.shared_expert.{gate_up,down}_proj.weight`` like a dense MLP,
  ``mlp.shared_expert_gate.weight`` replicated (not covered by the oracle). GLM-4.5-MoE:
  ``mlp.shared_experts.{gate_up,down}_proj.weight`` (no gate), the float32 router bias
  ``mlp.gate.e_score_correction_bias`` replicated, and the first ``first_k_dense`` layers
  dense; vLLM holds GLM's router ``mlp.gate.weight`` in float32 (`vllm_engine_dtypes`).
* MLA models (DeepSeek-V2/V3, Kimi-K2): `planner.presets.deepseek.mla_recipes`;
  `vllm_layout` picks the builder that describes a shape.
* Norms (``input_layernorm``, ``post_attention_layernorm``, ``q_norm``/``k_norm``,
  ``model.norm``) are replicated.
* Embedding and lm_head (`VocabParallelEmbedding` / `ParallelLMHead`): vLLM pads the vocabulary
  to a multiple of 64 (`VOCAB_PADDING`) and gives each rank ``padded / tp`` rows; rank r's real
  rows are ``[r * padded / tp, min((r + 1) * padded / tp, vocab))``, the rest of its shard is
  zero padding written once at load. The recipe and spec describe the real-row prefix of the
  rank's parameter (``param[:rows]``, contiguous at offset 0): a receiver registers that view,
  and the padding is never written. A tied lm_head has no recipe (vLLM shares the embedding).
* Sources: every recipe declares the global shape of each trainer tensor it reads (the HF
  shapes of `hf_parameter_shapes`); a trainer tensor of any other shape fails the plan. The
  one exception is a trainer's own vocabulary padding: with `PlannerConfig.allow_source_padding`
  a trainer's ``embed_tokens`` / ``lm_head`` may have more rows than ``vocab_size`` (trailing
  padding, never sent). Float dtypes are cast to the engine's.

vLLM requires tensor-parallel divisibility, so these recipes raise `ConfigurationError` (a
`ValueError`) naming the tensor when a size does not divide by tp; `planner.recipes` has the
generic, uneven-capable builders.

FP8 (``fp8=True``): the linear weights (qkv, o, gate_up, down, w13, w2, shared-expert
gate_up/down) become float8_e4m3fn with a ``<name>_scale_inv`` float32 tensor, quantized per
128x128 block of the engine rank's fused, sharded tensor; embeddings, norms, lm_head, routers
and biases stay in `param_dtype`. Quantizing the destination layout means per-rank sizes that
are not multiples of 128 work here (the scale tensor uses ceil); vLLM's own loader of
pre-quantized checkpoints refuses such partitions.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from weight_transfer.errors import ConfigurationError
from weight_transfer.planner.presets.models import MOE_LAYOUTS, ModelShape, MoeLayout
from weight_transfer.planner.recipes import (
    TensorSpec,
    column_shard,
    engine_tensor_specs,
    even_bounds,
    fused_gate_up,
    fused_qkv,
    identity,
    moe_w2,
    moe_w2_fused,
    moe_w13,
    moe_w13_fused,
    qkv_head_ranges,
    row_shard,
    with_fp8,
    with_padding,
)
from weight_transfer.planner.types import Range, Recipe

if TYPE_CHECKING:
    from weight_transfer.planner.presets.deepseek import MlaShape

VLLM_VERSION = "0.33.0"
"""The vLLM release whose conventions this preset reproduces."""
VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE."""
DEFAULT_MOE_PREFIX = "mlp.experts.routed_experts"
"""Where vLLM 0.33.0 keeps routed-expert parameters inside a layer (per the oracle; 0.32's
DeepSeek-V3 and GLM-4.5-MoE models too)."""
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"
"""Per-layer float32 router bias of ``noaux_tc`` routing (DeepSeek-V3, Kimi-K2, GLM-4.5-MoE)."""


def vocab_rows(vocab_size: int, tp_rank: int, tp_size: int) -> Range:
    """The real (unpadded) vocabulary rows vLLM places on rank `tp_rank`.

    Raises:
        ConfigurationError: the padded vocabulary does not divide by tp, or the rank would
            hold padding only.
    """
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp_size:
        raise ConfigurationError(
            f"model.embed_tokens.weight: padded vocabulary {padded} (vocab {vocab_size} padded "
            f"to a multiple of {VOCAB_PADDING}) is not divisible by tp_size {tp_size}"
        )
    per = padded // tp_size
    start, stop = tp_rank * per, min((tp_rank + 1) * per, vocab_size)
    if start >= stop:
        raise ConfigurationError(
            f"model.embed_tokens.weight: tp rank {tp_rank} of {tp_size} holds only vocabulary "
            f"padding (vocab {vocab_size}); this preset needs every rank to hold real rows"
        )
    return (start, stop)


def _even(size: int, tp_size: int, what: str) -> tuple[Range, ...]:
    try:
        return even_bounds(size, tp_size, what=what)
    except ValueError as exc:
        raise ConfigurationError(f"vLLM requires divisibility: {exc}") from None


def vllm_recipes(
    shape: ModelShape,
    tp_rank: int,
    tp_size: int,
    *,
    fp8: bool = False,
    moe_prefix: str = DEFAULT_MOE_PREFIX,
    hf_moe_layout: MoeLayout = "per_expert",
    fp8_block: tuple[int, int] = (128, 128),
) -> tuple[Recipe, ...]:
    """Recipes for every parameter of vLLM tensor-parallel rank `tp_rank` of `tp_size`.

    Sources are the HF trainer names of `planner.presets.models.hf_parameter_shapes(shape,
    moe_layout=hf_moe_layout)`. Recipes carry no dtype: `vllm_tensor_specs` gives the
    tensors (and dtypes) to allocate.

    Args:
        shape: the model.
        tp_rank: this engine rank's tensor-parallel rank.
        tp_size: the engine's tensor-parallel size.
        fp8: block-quantize the linear weights (module docstring).
        moe_prefix: where a layer's routed experts live in vLLM's module tree.
        hf_moe_layout: how the trainer holds experts ("per_expert" or "fused").
        fp8_block: quantization block (rows, cols).

    Raises:
        ConfigurationError: (a ValueError) naming the tensor or config that does not divide by
            `tp_size` as vLLM requires, or a bad rank.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigurationError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
    if hf_moe_layout not in MOE_LAYOUTS:
        raise ConfigurationError(
            f"hf_moe_layout must be one of {MOE_LAYOUTS}, got {hf_moe_layout!r}"
        )
    rank = _Rank(shape, tp_rank, tp_size, fp8, fp8_block, moe_prefix, hf_moe_layout)
    h = shape.hidden_size
    out: list[Recipe] = [rank.vocab("model.embed_tokens.weight")]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out.extend(rank.attention(p + "self_attn."))
        if shape.is_moe_layer(i):
            out.extend(rank.moe(p))
        else:
            out.extend(rank.dense_mlp(p + "mlp.", shape.intermediate_size))
        out.append(identity(p + "input_layernorm.weight", p + "input_layernorm.weight", (h,)))
        out.append(
            identity(
                p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (h,)
            )
        )
    out.append(identity("model.norm.weight", "model.norm.weight", (h,)))
    if not shape.tie_word_embeddings:
        out.append(rank.vocab("lm_head.weight"))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class _Rank:
    """One vLLM tensor-parallel rank's view of the model: builds its recipes block by block."""

    shape: ModelShape
    tp_rank: int
    tp_size: int
    fp8: bool
    fp8_block: tuple[int, int]
    moe_prefix: str
    hf_moe_layout: MoeLayout

    def quant(self, recipe: Recipe) -> Recipe:
        """The recipe, FP8 block-quantized if the engine holds FP8 linears."""
        return with_fp8(recipe, block=self.fp8_block) if self.fp8 else recipe

    def vocab(self, name: str) -> Recipe:
        """The embedding or LM head: vocabulary rows split over ranks, with vLLM's padding."""
        bounds = [vocab_rows(self.shape.vocab_size, r, self.tp_size) for r in range(self.tp_size)]
        recipe = column_shard(
            name,
            name,
            (self.shape.vocab_size, self.shape.hidden_size),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            bounds=bounds,
        )
        # A trainer may pad its vocabulary (Megatron-style); its padding rows are never sent.
        return with_padding(recipe, (0,))

    def attention(self, attn: str) -> list[Recipe]:
        """Fused qkv_proj (kv heads replicated when tp > kv heads), o_proj, optional qk norms."""
        shape, h, hd = self.shape, self.shape.hidden_size, self.shape.head_dim
        try:
            qkv_head_ranges(shape.num_heads, shape.num_kv_heads, self.tp_rank, self.tp_size)
        except ValueError as exc:
            raise ConfigurationError(
                f"{attn}qkv_proj.weight: vLLM cannot shard it: {exc}"
            ) from None
        out: list[Recipe] = []
        for suffix, trailing in (("weight", (h,)), ("bias", ())):
            if suffix == "bias" and not shape.qkv_bias:
                continue
            qkv = fused_qkv(
                attn + "qkv_proj." + suffix,
                attn + "q_proj." + suffix,
                attn + "k_proj." + suffix,
                attn + "v_proj." + suffix,
                num_heads=shape.num_heads,
                num_kv_heads=shape.num_kv_heads,
                head_dim=hd,
                trailing=trailing,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
            )
            out.append(self.quant(qkv) if suffix == "weight" else qkv)
        # o_proj's input dim splits by query heads, which divide by tp (checked above).
        out.append(
            self.quant(
                row_shard(
                    attn + "o_proj.weight",
                    attn + "o_proj.weight",
                    (h, shape.q_size),
                    tp_rank=self.tp_rank,
                    tp_size=self.tp_size,
                )
            )
        )
        if shape.qk_norm:
            out.append(identity(attn + "q_norm.weight", attn + "q_norm.weight", (hd,)))
            out.append(identity(attn + "k_norm.weight", attn + "k_norm.weight", (hd,)))
        return out

    def dense_mlp(self, prefix: str, inter: int) -> list[Recipe]:
        """Fused gate_up_proj (column-parallel) and down_proj (row-parallel)."""
        h, tp_rank, tp_size = self.shape.hidden_size, self.tp_rank, self.tp_size
        bounds = _even(inter, tp_size, f"{prefix}gate_up_proj.weight (intermediate {inter})")
        gate_up = fused_gate_up(
            prefix + "gate_up_proj.weight",
            prefix + "gate_proj.weight",
            prefix + "up_proj.weight",
            shape=(inter, h),
            tp_rank=tp_rank,
            tp_size=tp_size,
            bounds=bounds,
        )
        down = row_shard(
            prefix + "down_proj.weight",
            prefix + "down_proj.weight",
            (h, inter),
            tp_rank=tp_rank,
            tp_size=tp_size,
            bounds=bounds,
        )
        return [self.quant(gate_up), self.quant(down)]

    def moe(self, p: str) -> list[Recipe]:
        """Routed experts stacked into w13/w2, the router, and the shared expert if any."""
        shape, h, tp_rank, tp_size = self.shape, self.shape.hidden_size, self.tp_rank, self.tp_size
        e, inter = shape.num_experts, shape.moe_intermediate_size
        mp = p + self.moe_prefix + "."
        bounds = _even(inter, tp_size, f"{mp}w13_weight (moe_intermediate_size {inter})")
        if self.hf_moe_layout == "fused":
            w13 = moe_w13_fused(
                mp + "w13_weight",
                p + "mlp.experts.gate_up_proj",
                num_experts=e,
                intermediate_size=inter,
                hidden_size=h,
                tp_rank=tp_rank,
                tp_size=tp_size,
                bounds=bounds,
            )
            w2 = moe_w2_fused(
                mp + "w2_weight",
                p + "mlp.experts.down_proj",
                num_experts=e,
                hidden_size=h,
                intermediate_size=inter,
                tp_rank=tp_rank,
                tp_size=tp_size,
                bounds=bounds,
            )
        else:
            ex = [f"{p}mlp.experts.{x}." for x in range(e)]
            w13 = moe_w13(
                mp + "w13_weight",
                [s + "gate_proj.weight" for s in ex],
                [s + "up_proj.weight" for s in ex],
                intermediate_size=inter,
                hidden_size=h,
                tp_rank=tp_rank,
                tp_size=tp_size,
                bounds=bounds,
            )
            w2 = moe_w2(
                mp + "w2_weight",
                [s + "down_proj.weight" for s in ex],
                hidden_size=h,
                intermediate_size=inter,
                tp_rank=tp_rank,
                tp_size=tp_size,
                bounds=bounds,
            )
        out = [
            self.quant(w13),
            self.quant(w2),
            identity(p + "mlp.gate.weight", p + "mlp.gate.weight", (e, h)),
        ]
        if shape.router_bias:
            out.append(identity(p + ROUTER_BIAS, p + ROUTER_BIAS, (e,)))
        if shape.num_shared_experts:
            out.extend(self.dense_mlp(p + "mlp.shared_experts.", shape.num_shared_experts * inter))
        if shape.shared_expert_intermediate_size:
            out.extend(
                self.dense_mlp(p + "mlp.shared_expert.", shape.shared_expert_intermediate_size)
            )
            out.append(
                identity(
                    p + "mlp.shared_expert_gate.weight", p + "mlp.shared_expert_gate.weight", (1, h)
                )
            )
        return out


def vllm_engine_dtypes(shape: ModelShape) -> dict[str, str]:
    """Engine tensors vLLM does not hold in the model's dtype: the float32 router biases, and
    the routers where vLLM builds them in another dtype (`ModelShape.router_dtype`)."""
    out: dict[str, str] = {}
    for i in range(shape.num_layers):
        if not shape.is_moe_layer(i):
            continue
        p = f"model.layers.{i}."
        if shape.router_bias:
            out[p + ROUTER_BIAS] = "float32"
        if shape.router_dtype is not None:
            out[p + "mlp.gate.weight"] = shape.router_dtype
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class VllmRankLayout:
    """What one vLLM tensor-parallel rank holds of a model: its recipes, and the dtypes of the
    tensors that are not in the model's dtype."""

    recipes: tuple[Recipe, ...]
    dtypes: dict[str, str]
    """Engine tensor name -> dtype, where it is not the model's dtype."""

    def specs(self, param_dtype: str) -> tuple[TensorSpec, ...]:
        """The tensors to allocate (or check against the live model) for `param_dtype`."""
        return engine_tensor_specs(self.recipes, param_dtype=param_dtype, dtypes=self.dtypes)


def vllm_layout(
    shape: ModelShape | MlaShape,
    tp_rank: int,
    tp_size: int,
    *,
    fp8: bool = False,
    moe_prefix: str = DEFAULT_MOE_PREFIX,
    hf_moe_layout: MoeLayout = "per_expert",
    fp8_block: tuple[int, int] = (128, 128),
) -> VllmRankLayout:
    """The layout of vLLM rank `tp_rank` of `tp_size` for any shape `from_hf_config` returns:
    `vllm_recipes` for a `ModelShape`, `planner.presets.deepseek.mla_recipes` (no expert
    parallelism) for an `MlaShape`.

    Raises:
        ConfigurationError: as the builder of that shape.
    """
    from weight_transfer.planner.presets.deepseek import MlaShape, mla_engine_dtypes, mla_recipes

    if isinstance(shape, MlaShape):
        return VllmRankLayout(
            recipes=mla_recipes(
                shape,
                tp_rank=tp_rank,
                tp_size=tp_size,
                fp8=fp8,
                fp8_block=fp8_block,
                moe_prefix=moe_prefix,
                hf_moe_layout=hf_moe_layout,
            ),
            dtypes=mla_engine_dtypes(shape),
        )
    return VllmRankLayout(
        recipes=vllm_recipes(
            shape,
            tp_rank,
            tp_size,
            fp8=fp8,
            moe_prefix=moe_prefix,
            hf_moe_layout=hf_moe_layout,
            fp8_block=fp8_block,
        ),
        dtypes=vllm_engine_dtypes(shape),
    )


def vllm_tensor_specs(
    shape: ModelShape,
    tp_rank: int,
    tp_size: int,
    *,
    fp8: bool = False,
    param_dtype: str = "bfloat16",
    moe_prefix: str = DEFAULT_MOE_PREFIX,
    hf_moe_layout: MoeLayout = "per_expert",
    fp8_block: tuple[int, int] = (128, 128),
) -> tuple[TensorSpec, ...]:
    """The tensors vLLM rank `tp_rank` holds (name, shape, dtype), FP8 scales included.

    An engine process (or a test standing in for one) allocates exactly these and registers
    them with a `WeightReceiver` together with `vllm_recipes(...)` of the same arguments.
    """
    return engine_tensor_specs(
        vllm_recipes(
            shape,
            tp_rank,
            tp_size,
            fp8=fp8,
            moe_prefix=moe_prefix,
            hf_moe_layout=hf_moe_layout,
            fp8_block=fp8_block,
        ),
        param_dtype=param_dtype,
        dtypes=vllm_engine_dtypes(shape),
    )
