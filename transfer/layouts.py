"""Engine layouts: which tensors an engine rank holds and the recipes that build them.

A `WeightReceiver` takes the engine's live tensors and a layout. `VllmLayout` is the layout of
vLLM's conventions (fused `qkv_proj` / `gate_up_proj`, tensor-parallel shards, MoE `w13`/`w2`,
optional FP8 blocks) from a model's HF config; any object with a `recipes` attribute (or a plain
sequence of recipes) serves an engine with conventions of its own.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from weight_transfer.manifest import allocate_engine_tensors
from weight_transfer.planner.presets.deepseek import MlaShape
from weight_transfer.planner.presets.models import (
    ModelShape,
    MoeLayout,
    from_hf_config,
    get_model_shape,
)
from weight_transfer.planner.presets.vllm import (
    DEFAULT_MOE_PREFIX,
    vllm_layout,
    vllm_recipes,
    vllm_tensor_specs,
)
from weight_transfer.planner.recipes import TensorSpec
from weight_transfer.planner.types import Recipe

__all__ = ["Layout", "VllmLayout"]


@runtime_checkable
class Layout(Protocol):
    """What a `WeightReceiver` needs to know about an engine rank's tensors."""

    @property
    def recipes(self) -> tuple[Recipe, ...]:
        """How each engine tensor is built from trainer tensors."""
        ...


class VllmLayout:
    """One vLLM tensor-parallel rank's tensors and recipes, from the model's shape.

    ``VllmLayout(hf_config, tp_rank, tp_size)`` gives `recipes` (for `WeightReceiver`),
    `tensor_specs` (name, shape, dtype of every tensor the rank holds, FP8 scales included) and
    `allocate()` (those tensors, for an engine that has none of its own yet). Covered model
    families: those `from_hf_config` reads (Llama, Mistral, Qwen2/3, Qwen2/3-MoE, GLM-4.5-MoE,
    DeepSeek-V3 / Kimi-K2 with MLA).
    """

    def __init__(
        self,
        model: Any,
        tp_rank: int,
        tp_size: int,
        *,
        fp8: bool = False,
        param_dtype: str = "bfloat16",
        hf_moe_layout: MoeLayout = "per_expert",
        moe_prefix: str = DEFAULT_MOE_PREFIX,
    ) -> None:
        """Derive the rank's recipes and tensors.

        Args:
            model: a transformers config (or its ``config.json`` dict), a `ModelShape` or
                `MlaShape`, or the
                name of a shape preset (`weight_transfer.MODEL_SHAPES`).
            tp_rank, tp_size: this engine rank's tensor-parallel rank and size.
            fp8: the linear weights are FP8 e4m3, 128x128 blocks (with `weight_scale_inv`).
            param_dtype: dtype of the other tensors.
            hf_moe_layout: how the trainer holds MoE experts ("per_expert" or "fused").
            moe_prefix: where a layer's routed experts live in vLLM's module tree.

        Raises:
            ConfigurationError: (a ValueError) the model does not shard over `tp_size` as vLLM
                requires, or a bad rank, naming the tensor; ValueError: an unreadable config.
        """
        shape: ModelShape | MlaShape
        if isinstance(model, (ModelShape, MlaShape)):
            shape = model
        elif isinstance(model, str):
            shape = get_model_shape(model)
        else:
            shape = from_hf_config(model)
        self.shape = shape
        """The model's shape."""
        self.tp_rank, self.tp_size = tp_rank, tp_size
        kw: dict[str, Any] = {"fp8": fp8, "moe_prefix": moe_prefix, "hf_moe_layout": hf_moe_layout}
        self.tensor_specs: tuple[TensorSpec, ...]
        """Every tensor this rank holds (name, shape, dtype)."""
        if isinstance(shape, MlaShape):
            layout = vllm_layout(shape, tp_rank, tp_size, **kw)
            self._recipes = layout.recipes
            self.tensor_specs = layout.specs(param_dtype)
        else:
            self._recipes = vllm_recipes(shape, tp_rank, tp_size, **kw)
            self.tensor_specs = vllm_tensor_specs(
                shape, tp_rank, tp_size, param_dtype=param_dtype, **kw
            )

    @property
    def recipes(self) -> tuple[Recipe, ...]:
        """How each of this rank's tensors is built from the trainer's (HF-named) tensors."""
        return self._recipes

    def allocate(
        self, device: str | torch.device = "cpu", *, seed: int | None = None
    ) -> dict[str, torch.Tensor]:
        """New tensors for this rank (`torch.empty`, or seeded random values with `seed`)."""
        return allocate_engine_tensors(self.tensor_specs, device=device, seed=seed)

    def __repr__(self) -> str:
        return f"VllmLayout(tp {self.tp_rank}/{self.tp_size}, {len(self._recipes)} recipes)"
