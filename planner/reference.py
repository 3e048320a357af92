"""Reference materializer: builds engine tensors from full trainer tensors by applying recipes.

This is the oracle the transfer pipeline is checked against. It is deliberately simple and
independent of the planner and of the recipe builders: for each recipe it allocates the
destination, copies every part's source box into its destination box (casting between float
dtypes), and for FP8 recipes assembles the whole destination in float32 and quantizes it with
`planner.fp8.quantize_fp8_blockwise` (the weight and its scale tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch

from weight_transfer.planner.fp8 import quantize_fp8_blockwise, scale_shape
from weight_transfer.planner.types import (
    DTYPE_SIZES,
    FLOAT_DTYPES,
    Box,
    Recipe,
    box_shape,
    numel,
    squeeze_shape,
)

FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"


class TensorSpecLike(Protocol):
    """Anything naming a tensor with its shape and dtype (`TensorSpec`, `DestTensor`)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...


def dtype_name(dtype: torch.dtype) -> str:
    """The project's name of a torch dtype ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a project dtype name.

    Raises:
        ValueError: unknown name.
    """
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {name!r}; known: {sorted(DTYPE_SIZES)}")
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _check_box(box: Box, shape: tuple[int, ...], what: str) -> None:
    if len(box) != len(shape):
        raise ValueError(
            f"{what}: box {box} has {len(box)} dims, tensor shape {shape} has {len(shape)}"
        )
    for (a, b), n in zip(box, shape, strict=True):
        if not (0 <= a < b <= n):
            raise ValueError(f"{what}: box {box} is empty or outside shape {shape}")


def check_coverage(recipe: Recipe, dest_shape: tuple[int, ...]) -> None:
    """Check that a recipe's parts cover a destination of `dest_shape` exactly once.

    Every part's destination box must lie inside the destination, be non-empty, and have the
    same shape as its source box once size-1 dimensions are dropped; no two parts may overlap;
    together they must fill every element.

    Raises:
        ValueError: naming the destination tensor and the offending part(s).
    """
    name = recipe.dest
    if not recipe.parts and numel(dest_shape) > 0:
        raise ValueError(f"recipe for {name!r} has no parts but the tensor has shape {dest_shape}")
    for part in recipe.parts:
        _check_box(part.dest_box, dest_shape, f"recipe for {name!r}, part from {part.source!r}")
        if any(not (0 <= a < b) for a, b in part.source_box):
            raise ValueError(
                f"recipe for {name!r}: source box {part.source_box} of "
                f"{part.source!r} is empty or negative"
            )
        if squeeze_shape(box_shape(part.source_box)) != squeeze_shape(box_shape(part.dest_box)):
            raise ValueError(
                f"recipe for {name!r}: part from {part.source!r} maps source box "
                f"{part.source_box} onto dest box {part.dest_box} of a different shape"
            )
    # Sweep along dim 0: only parts whose dim-0 ranges overlap can collide, which keeps
    # stacked-expert and fused recipes (hundreds of parts) linear in practice.
    order = sorted(range(len(recipe.parts)), key=lambda i: recipe.parts[i].dest_box)
    active: list[int] = []
    for i in order:
        box = recipe.parts[i].dest_box
        active = [j for j in active if recipe.parts[j].dest_box[0][1] > box[0][0]]
        for j in active:
            other = recipe.parts[j].dest_box
            if all(
                max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(box, other, strict=True)
            ):
                raise ValueError(
                    f"recipe for {name!r}: parts from {recipe.parts[j].source!r} (dest box "
                    f"{other}) and {recipe.parts[i].source!r} (dest box {box}) overlap"
                )
        active.append(i)
    covered = sum(numel(box_shape(p.dest_box)) for p in recipe.parts)
    if covered != numel(dest_shape):
        raise ValueError(
            f"recipe for {name!r}: parts cover {covered} of {numel(dest_shape)} elements of "
            f"shape {dest_shape} (gaps)"
        )


def _source_box(
    sources: Mapping[str, torch.Tensor], dest: str, source: str, box: Box
) -> torch.Tensor:
    try:
        tensor = sources[source]
    except KeyError:
        raise ValueError(
            f"engine tensor {dest!r} needs source tensor {source!r}, which was not given"
        ) from None
    _check_box(box, tuple(tensor.shape), f"engine tensor {dest!r}, source {source!r}")
    return tensor[_slices(box)]


QuantizeInto = Callable[[torch.Tensor, tuple[int, int], torch.Tensor, torch.Tensor], None]
"""`(x, block, out_q, out_scale)`: quantize the 2-D float `x` into `out_q` and `out_scale`."""


def _reference_quantize_into(
    x: torch.Tensor, block: tuple[int, int], out_q: torch.Tensor, out_scale: torch.Tensor
) -> None:
    q, scale = quantize_fp8_blockwise(x, block)
    out_q.copy_(q)
    out_scale.copy_(scale)


def apply_recipe(
    recipe: Recipe,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    sources: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    quantize: QuantizeInto | None = None,
) -> dict[str, torch.Tensor]:
    """Build one engine tensor (and, for an FP8 recipe, its scale) from full trainer tensors.

    The one place a recipe is applied outside the pipeline: `materialize`, the benchmarks'
    verification and the rank-0 baseline's engine-side load all use it. Each part's source box
    is copied into its destination box, cast to `dtype`; an FP8 recipe assembles the
    destination in float32 (every float source casts into it exactly or as any float32
    assembly would) one leading (expert) slice at a time, bounding memory, and quantizes each.

    Args:
        device: where the result lives (default: `out`'s tensors, else the first source's).
        out: tensors to write into (the destination and, for FP8, its scale) instead of new ones,
            as an engine's loader does.
        quantize: the FP8 quantizer (default: `quantize_fp8_blockwise`, the reference); a fast
            kernel with the same rounding may stand in.

    Raises:
        ValueError: a missing source or a box outside its tensor (named).
    """
    name = recipe.dest
    if device is None:
        if out is not None:
            device = out[name].device
        else:
            device = next(iter(sources.values())).device if sources else "cpu"
    if recipe.quant is None:
        dest = out[name] if out is not None else torch.empty(shape, dtype=dtype, device=device)
        for part in recipe.parts:
            src = _source_box(sources, name, part.source, part.source_box)
            region = dest[_slices(part.dest_box)]
            region.copy_(src.reshape(region.shape).to(device=device, dtype=dtype))
        return {name: dest}
    quant = recipe.quant
    if not 2 <= len(shape) <= 3:
        raise ValueError(f"FP8 recipe for {name!r}: expected 2 or 3 dims, shape is {shape}")
    into = quantize or _reference_quantize_into
    if out is not None:
        weight, scale = out[name], out[quant.scale_dest]
    else:
        weight = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty(scale_shape(shape, quant.block), dtype=torch.float32, device=device)
    lead = shape[0] if len(shape) > 2 else 1
    for e in range(lead):
        # One 2-D slice at a time: an expert of a stacked MoE tensor, or the whole matrix.
        hp = torch.empty(shape[-2:], dtype=torch.float32, device=device)
        for part in recipe.parts:
            if len(shape) > 2 and not part.dest_box[0][0] <= e < part.dest_box[0][1]:
                continue
            src = _source_box(sources, name, part.source, part.source_box)
            if len(shape) > 2:
                # The part's rows of expert e (its box may span several experts).
                k = e - part.dest_box[0][0]
                src = src.reshape(box_shape(part.dest_box))[k]
            region = hp[_slices(part.dest_box[-2:])]
            region.copy_(src.reshape(region.shape).to(device=device, dtype=torch.float32))
        q = weight if len(shape) == 2 else weight[e]
        s = scale if len(shape) == 2 else scale[e]
        into(hp, quant.block, q, s)
    return {name: weight, quant.scale_dest: scale}


def materialize(
    recipes: Iterable[Recipe],
    dest_specs: Iterable[TensorSpecLike],
    sources: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Build every engine tensor the recipes describe from full (unsharded) trainer tensors.

    Args:
        recipes: one recipe per engine tensor.
        dest_specs: name, shape and dtype of every engine tensor, including FP8 scale tensors.
        sources: full trainer tensors by name (CPU or any device; results are on CPU).

    Returns:
        Engine tensors by name: each recipe's destination, plus the scale tensor of each FP8
        recipe.

    Raises:
        ValueError: naming the tensor: a destination or scale without a spec, a duplicate
            destination, a missing source, a box outside its tensor, parts that do not cover the
            destination exactly once, a cast that is not between float dtypes, a wrong scale
            shape or dtype.
    """
    specs = {s.name: s for s in dest_specs}
    out: dict[str, torch.Tensor] = {}
    for recipe in recipes:
        name = recipe.dest
        if name in out:
            raise ValueError(f"engine tensor {name!r} is built twice (duplicate recipe or scale)")
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"recipe for {name!r} has no destination spec")
        shape = tuple(spec.shape)
        check_coverage(recipe, shape)
        _check_casts(recipe, spec, sources)
        if recipe.quant is not None:
            _check_scale_spec(recipe, spec, specs, out)
        out.update(apply_recipe(recipe, shape, torch_dtype(spec.dtype), sources, device="cpu"))
    return out


def _check_casts(recipe: Recipe, spec: TensorSpecLike, sources: Mapping[str, torch.Tensor]) -> None:
    """Only float-to-float casts, and FP8 only from floats (naming the tensors)."""
    name = recipe.dest
    for part in recipe.parts:
        src = _source_box(sources, name, part.source, part.source_box)
        src_dtype = dtype_name(src.dtype)
        if recipe.quant is not None:
            if src_dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"FP8 engine tensor {name!r} cannot quantize {part.source!r} "
                    f"of dtype {src_dtype}"
                )
        elif src_dtype != spec.dtype and not (
            src_dtype in FLOAT_DTYPES and spec.dtype in FLOAT_DTYPES
        ):
            raise ValueError(
                f"engine tensor {name!r} ({spec.dtype}) cannot be built "
                f"from {part.source!r} ({src_dtype}): only float casts"
            )


def _check_scale_spec(
    recipe: Recipe,
    spec: TensorSpecLike,
    specs: Mapping[str, TensorSpecLike],
    built: Mapping[str, torch.Tensor],
) -> None:
    """An FP8 recipe's weight and scale specs match what the quantizer makes."""
    assert recipe.quant is not None
    name, quant, shape = recipe.dest, recipe.quant, tuple(spec.shape)
    if spec.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 recipe for {name!r} but its spec says dtype {spec.dtype!r}")
    if len(shape) < 2:
        raise ValueError(f"FP8 recipe for {name!r} needs >= 2 dims, shape is {shape}")
    scale_spec = specs.get(quant.scale_dest)
    want = scale_shape(shape, quant.block)
    if scale_spec is None:
        raise ValueError(
            f"FP8 recipe for {name!r}: scale tensor {quant.scale_dest!r} has no destination spec"
        )
    if tuple(scale_spec.shape) != want or scale_spec.dtype != SCALE_DTYPE:
        raise ValueError(
            f"scale tensor {quant.scale_dest!r} of {name!r} is {scale_spec.dtype} "
            f"{tuple(scale_spec.shape)}, expected {SCALE_DTYPE} {want}"
        )
    if quant.scale_dest in built:
        raise ValueError(f"engine tensor {quant.scale_dest!r} is built twice")
