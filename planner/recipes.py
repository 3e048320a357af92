"""Engine-agnostic recipe builders: identity, tensor-parallel shards, fusions, MoE stacks, FP8.

Every builder returns a `planner.types.Recipe` whose parts cover the destination exactly once
(boxes are per-dimension half-open ``[start, stop)`` ranges). Builders know nothing about any
engine's names or divisibility rules; presets (`planner.presets.vllm`) add those.

Every recipe also declares the global shape of each trainer tensor it reads
(`Recipe.sources`): the planner refuses a trainer tensor of any other shape instead of reading
the boxes it needs out of a larger one. `with_padding` marks dimensions along which a trainer
may hold trailing padding that no part reads (accepted only with
`PlannerConfig.allow_source_padding`).

Sharding rule for uneven sizes (`split_bounds`): a dimension of size ``n`` split over ``p``
ranks gives the first ``n % p`` ranks ``n // p + 1`` rows and the others ``n // p``
(numpy's ``array_split``). An engine with another rule passes explicit `bounds`: one
``(start, stop)`` per rank, tiling ``[0, n)`` in rank order. An empty shard is an error: an
engine tensor with no elements has nothing to receive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from weight_transfer.planner.fp8 import scale_shape
from weight_transfer.planner.reference import FP8_DTYPE, SCALE_DTYPE, check_coverage
from weight_transfer.planner.types import (
    DTYPE_SIZES,
    Box,
    Fp8BlockQuant,
    Part,
    Range,
    Recipe,
    SourceSpec,
)

SCALE_SUFFIX = "_scale_inv"
"""Appended to an FP8 weight's name to name its scale tensor (``w13_weight_scale_inv``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor an engine must allocate: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


# ---------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------


def _check_rank(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")


def split_bounds(size: int, num_parts: int) -> tuple[Range, ...]:
    """Per-rank ``[start, stop)`` of a dimension of `size` split over `num_parts` ranks.

    Uneven sizes are allowed: the first ``size % num_parts`` ranks get one extra row.
    """
    if num_parts < 1 or size < 0:
        raise ValueError(f"cannot split size {size} into {num_parts} parts")
    base, extra = divmod(size, num_parts)
    bounds = []
    start = 0
    for r in range(num_parts):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def even_bounds(size: int, num_parts: int, *, what: str) -> tuple[Range, ...]:
    """Like `split_bounds` but requires `size` to divide evenly (vLLM's rule).

    Raises:
        ValueError: naming `what` when `size` is not a multiple of `num_parts`.
    """
    if num_parts < 1 or size % num_parts:
        raise ValueError(
            f"{what}: size {size} is not divisible by tensor-parallel size {num_parts}"
        )
    return split_bounds(size, num_parts)


def _rank_range(
    size: int, tp_rank: int, tp_size: int, bounds: Sequence[Range] | None, what: str
) -> Range:
    _check_rank(tp_rank, tp_size)
    if bounds is None:
        bounds = split_bounds(size, tp_size)
    else:
        bounds = tuple((int(a), int(b)) for a, b in bounds)
        if len(bounds) != tp_size:
            raise ValueError(f"{what}: {len(bounds)} bounds given for tp_size {tp_size}")
        expect = 0
        for a, b in bounds:
            if a != expect or b < a:
                raise ValueError(f"{what}: bounds {bounds} do not tile [0, {size}) in order")
            expect = b
        if expect != size:
            raise ValueError(f"{what}: bounds {bounds} do not tile [0, {size})")
    start, stop = bounds[tp_rank]
    if start == stop:
        raise ValueError(
            f"{what}: tensor-parallel rank {tp_rank} of {tp_size} would hold an "
            f"empty shard of a dimension of size {size}"
        )
    return (start, stop)


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _specs(dest: str, shapes: Iterable[tuple[str, Sequence[int]]]) -> tuple[SourceSpec, ...]:
    """One `SourceSpec` per distinct source name, in first-seen order.

    Raises:
        ValueError: one source given with two different shapes.
    """
    out: dict[str, SourceSpec] = {}
    for name, shape in shapes:
        shp = tuple(int(n) for n in shape)
        got = out.get(name)
        if got is None:
            out[name] = SourceSpec(name=name, shape=shp)
        elif got.shape != shp:
            raise ValueError(f"{dest!r}: source {name!r} given with shapes {got.shape} and {shp}")
    return tuple(out.values())


def with_padding(recipe: Recipe, dims: Sequence[int]) -> Recipe:
    """The same recipe, accepting trainer tensors padded (larger) along `dims`.

    The parts still read only the declared shape; the trailing padding of the trainer's tensor
    is never sent. The planner accepts it only with `PlannerConfig.allow_source_padding`.
    """
    pad = tuple(sorted({int(d) for d in dims}))
    specs = []
    for spec in recipe.sources:
        if any(not 0 <= d < len(spec.shape) for d in pad):
            raise ValueError(f"{recipe.dest!r}: padded dims {pad} out of range for {spec.shape}")
        specs.append(dataclasses.replace(spec, padded_dims=pad))
    return dataclasses.replace(recipe, sources=tuple(specs))


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------


def identity(dest: str, source: str, shape: Sequence[int]) -> Recipe:
    """The whole source tensor is the destination (replicated tensors: norms, routers)."""
    box = _full(shape)
    return Recipe(
        dest=dest,
        parts=(Part(source=source, source_box=box, dest_box=box),),
        sources=_specs(dest, [(source, shape)]),
    )


def shard(
    dest: str,
    source: str,
    shape: Sequence[int],
    *,
    dim: int,
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
) -> Recipe:
    """Rank `tp_rank`'s slice of `source` (global `shape`) along `dim`.

    Args:
        bounds: explicit per-rank ``[start, stop)`` along `dim`; default `split_bounds`.
    """
    shape = tuple(int(n) for n in shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"{dest!r}: dim {dim} out of range for shape {shape}")
    start, stop = _rank_range(shape[dim], tp_rank, tp_size, bounds, f"shard of {source!r}")
    src = list(_full(shape))
    src[dim] = (start, stop)
    dst = list(_full(shape))
    dst[dim] = (0, stop - start)
    return Recipe(
        dest=dest,
        parts=(Part(source=source, source_box=tuple(src), dest_box=tuple(dst)),),
        sources=_specs(dest, [(source, shape)]),
    )


def column_shard(
    dest: str,
    source: str,
    shape: Sequence[int],
    *,
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
) -> Recipe:
    """Column-parallel shard: split dim 0 (output features)."""
    return shard(dest, source, shape, dim=0, tp_rank=tp_rank, tp_size=tp_size, bounds=bounds)


def row_shard(
    dest: str,
    source: str,
    shape: Sequence[int],
    *,
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
) -> Recipe:
    """Row-parallel shard: split dim 1 (input features)."""
    return shard(dest, source, shape, dim=1, tp_rank=tp_rank, tp_size=tp_size, bounds=bounds)


def concat_rows(dest: str, pieces: Sequence[tuple[str, Sequence[int], Range]]) -> Recipe:
    """Concatenate row ranges of several sources along dim 0, in order.

    Args:
        pieces: ``(source, global source shape, (row_start, row_stop))``; all sources must
            share their trailing dimensions.
    """
    if not pieces:
        raise ValueError(f"{dest!r}: nothing to concatenate")
    trailing = tuple(int(n) for n in pieces[0][1][1:])
    parts = []
    offset = 0
    for source, shape, (a, b) in pieces:
        if tuple(int(n) for n in shape[1:]) != trailing:
            raise ValueError(
                f"{dest!r}: {source!r} has shape {tuple(shape)}, trailing dims "
                f"differ from {trailing}"
            )
        if not 0 <= a < b <= shape[0]:
            raise ValueError(
                f"{dest!r}: rows [{a}, {b}) of {source!r} are empty or outside its {shape[0]} rows"
            )
        parts.append(
            Part(
                source=source,
                source_box=((a, b), *_full(trailing)),
                dest_box=((offset, offset + b - a), *_full(trailing)),
            )
        )
        offset += b - a
    return Recipe(
        dest=dest,
        parts=tuple(parts),
        sources=_specs(dest, [(source, shape) for source, shape, _ in pieces]),
    )


def qkv_head_ranges(
    num_heads: int, num_kv_heads: int, tp_rank: int, tp_size: int
) -> tuple[Range, Range]:
    """Query heads and kv heads ``[start, stop)`` that tensor-parallel rank `tp_rank` holds.

    Query heads split evenly. With tp_size <= num_kv_heads, kv heads split evenly too; with
    tp_size > num_kv_heads each kv head is replicated on tp_size // num_kv_heads consecutive
    ranks: rank r holds kv head r // (tp_size // num_kv_heads).

    Raises:
        ValueError: naming the config when heads do not divide as above.
    """
    _check_rank(tp_rank, tp_size)
    config = f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, tp_size={tp_size}"
    if num_heads % tp_size:
        raise ValueError(
            f"attention heads do not split over tensor parallelism ({config}): "
            "num_heads must be a multiple of tp_size"
        )
    q_per = num_heads // tp_size
    q = (tp_rank * q_per, (tp_rank + 1) * q_per)
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(
                f"kv heads cannot be replicated evenly ({config}): tp_size must "
                "be a multiple of num_kv_heads"
            )
        kv_head = tp_rank // (tp_size // num_kv_heads)
        return q, (kv_head, kv_head + 1)
    if num_kv_heads % tp_size:
        raise ValueError(
            f"kv heads do not split over tensor parallelism ({config}): "
            "num_kv_heads must be a multiple of tp_size"
        )
    kv_per = num_kv_heads // tp_size
    return q, (tp_rank * kv_per, (tp_rank + 1) * kv_per)


def fused_qkv(
    dest: str,
    q: str,
    k: str,
    v: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    trailing: Sequence[int],
    tp_rank: int,
    tp_size: int,
) -> Recipe:
    """Fused qkv shard of rank `tp_rank`: ``[q rows of r | k rows of r | v rows of r]``.

    Args:
        q, k, v: source names; shapes ``(num_heads * head_dim, *trailing)`` for q and
            ``(num_kv_heads * head_dim, *trailing)`` for k and v (``trailing`` is
            ``(hidden,)`` for weights, ``()`` for biases).
    """
    (q0, q1), (k0, k1) = qkv_head_ranges(num_heads, num_kv_heads, tp_rank, tp_size)
    trailing = tuple(int(n) for n in trailing)
    kv_shape = (num_kv_heads * head_dim, *trailing)
    return concat_rows(
        dest,
        [
            (q, (num_heads * head_dim, *trailing), (q0 * head_dim, q1 * head_dim)),
            (k, kv_shape, (k0 * head_dim, k1 * head_dim)),
            (v, kv_shape, (k0 * head_dim, k1 * head_dim)),
        ],
    )


def fused_gate_up(
    dest: str,
    gate: str,
    up: str,
    *,
    shape: Sequence[int],
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
) -> Recipe:
    """Fused gate_up shard of rank `tp_rank`: ``[gate rows of r | up rows of r]``.

    Args:
        shape: global shape of gate and of up, ``(intermediate, hidden)``.
        bounds: explicit per-rank row ranges of the intermediate dimension.
    """
    rows = _rank_range(int(shape[0]), tp_rank, tp_size, bounds, f"gate/up {gate!r}")
    return concat_rows(dest, [(gate, shape, rows), (up, shape, rows)])


def moe_w13(
    dest: str,
    gates: Sequence[str],
    ups: Sequence[str],
    *,
    intermediate_size: int,
    hidden_size: int,
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
) -> Recipe:
    """Stacked expert w13 ``[E, 2 * I_r, H]`` from per-expert gate and up ``[I, H]``.

    Expert e's slice is ``[gate_e rows of r | up_e rows of r]``.
    """
    if len(gates) != len(ups) or not gates:
        raise ValueError(
            f"{dest!r}: need as many gate as up experts (got {len(gates)}, {len(ups)})"
        )
    a, b = _rank_range(intermediate_size, tp_rank, tp_size, bounds, f"experts of {dest!r}")
    n, h = b - a, hidden_size
    parts = []
    for e, (gate, up) in enumerate(zip(gates, ups, strict=True)):
        parts.append(
            Part(source=gate, source_box=((a, b), (0, h)), dest_box=((e, e + 1), (0, n), (0, h)))
        )
        parts.append(
            Part(source=up, source_box=((a, b), (0, h)), dest_box=((e, e + 1), (n, 2 * n), (0, h)))
        )
    full = (intermediate_size, hidden_size)
    return Recipe(
        dest=dest,
        parts=tuple(parts),
        sources=_specs(dest, [(s, full) for pair in zip(gates, ups, strict=True) for s in pair]),
    )


def moe_w13_fused(
    dest: str,
    gate_up: str,
    *,
    num_experts: int,
    intermediate_size: int,
    hidden_size: int,
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
    experts: Range | None = None,
) -> Recipe:
    """Stacked expert w13 ``[E, 2 * I_r, H]`` from a stacked ``gate_up [E, 2 * I, H]``
    (gate rows first, up rows second per expert, as transformers >= 5 holds them).

    Args:
        experts: only experts ``[start, stop)`` of the source (expert parallelism: the engine
            rank holds those whole); default all `num_experts`.
    """
    a, b = _rank_range(intermediate_size, tp_rank, tp_size, bounds, f"experts of {dest!r}")
    e0, e1 = _expert_range(dest, num_experts, experts)
    n, h, e, i = b - a, hidden_size, e1 - e0, intermediate_size
    return Recipe(
        dest=dest,
        parts=(
            Part(
                source=gate_up,
                source_box=((e0, e1), (a, b), (0, h)),
                dest_box=((0, e), (0, n), (0, h)),
            ),
            Part(
                source=gate_up,
                source_box=((e0, e1), (i + a, i + b), (0, h)),
                dest_box=((0, e), (n, 2 * n), (0, h)),
            ),
        ),
        sources=_specs(dest, [(gate_up, (e, 2 * i, h))]),
    )


def _expert_range(dest: str, num_experts: int, experts: Range | None) -> Range:
    if experts is None:
        return (0, num_experts)
    e0, e1 = int(experts[0]), int(experts[1])
    if not 0 <= e0 < e1 <= num_experts:
        raise ValueError(f"{dest!r}: experts [{e0}, {e1}) are empty or outside [0, {num_experts})")
    return (e0, e1)


def moe_w2(
    dest: str,
    downs: Sequence[str],
    *,
    hidden_size: int,
    intermediate_size: int,
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
) -> Recipe:
    """Stacked expert w2 ``[E, H, I_r]`` from per-expert down ``[H, I]`` (columns of r)."""
    if not downs:
        raise ValueError(f"{dest!r}: no experts")
    a, b = _rank_range(intermediate_size, tp_rank, tp_size, bounds, f"experts of {dest!r}")
    h = hidden_size
    return Recipe(
        dest=dest,
        parts=tuple(
            Part(
                source=down, source_box=((0, h), (a, b)), dest_box=((e, e + 1), (0, h), (0, b - a))
            )
            for e, down in enumerate(downs)
        ),
        sources=_specs(dest, [(down, (h, intermediate_size)) for down in downs]),
    )


def moe_w2_fused(
    dest: str,
    down: str,
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    tp_rank: int,
    tp_size: int,
    bounds: Sequence[Range] | None = None,
    experts: Range | None = None,
) -> Recipe:
    """Stacked expert w2 ``[E, H, I_r]`` from a stacked ``down [E, H, I]``.

    Args:
        experts: as `moe_w13_fused`.
    """
    a, b = _rank_range(intermediate_size, tp_rank, tp_size, bounds, f"experts of {dest!r}")
    e0, e1 = _expert_range(dest, num_experts, experts)
    h = hidden_size
    return Recipe(
        dest=dest,
        parts=(
            Part(
                source=down,
                source_box=((e0, e1), (0, h), (a, b)),
                dest_box=((0, e1 - e0), (0, h), (0, b - a)),
            ),
        ),
        sources=_specs(dest, [(down, (num_experts, h, intermediate_size))]),
    )


def scale_name(dest: str) -> str:
    """Name of the scale tensor of FP8 weight `dest` (``...weight`` -> ``...weight_scale_inv``)."""
    return dest + SCALE_SUFFIX


def with_fp8(recipe: Recipe, *, block: tuple[int, int] = (128, 128)) -> Recipe:
    """The same recipe, block-quantized to FP8 e4m3 after assembly, scales in `scale_name`."""
    return dataclasses.replace(
        recipe, quant=Fp8BlockQuant(scale_dest=scale_name(recipe.dest), block=block)
    )


# ---------------------------------------------------------------------------------------------
# What an engine allocates
# ---------------------------------------------------------------------------------------------


def recipe_shape(recipe: Recipe) -> tuple[int, ...]:
    """Shape of a recipe's destination, inferred from its parts and checked for exact cover.

    Raises:
        ValueError: no parts, parts of different ranks, or parts that do not tile the shape.
    """
    if not recipe.parts:
        raise ValueError(f"recipe for {recipe.dest!r} has no parts")
    ndims = {len(p.dest_box) for p in recipe.parts}
    if len(ndims) != 1:
        raise ValueError(f"recipe for {recipe.dest!r} mixes dest boxes of ranks {sorted(ndims)}")
    shape = tuple(max(p.dest_box[d][1] for p in recipe.parts) for d in range(ndims.pop()))
    check_coverage(recipe, shape)
    return shape


def engine_tensor_specs(
    recipes: Iterable[Recipe],
    *,
    param_dtype: str = "bfloat16",
    dtypes: Mapping[str, str] | None = None,
) -> tuple[TensorSpec, ...]:
    """The tensors an engine must allocate for `recipes`, in recipe order.

    FP8 recipes give a float8_e4m3fn weight followed by its float32 scale tensor of shape
    `planner.fp8.scale_shape` of the (fused, sharded) weight; other recipes give a tensor of
    `dtypes[name]`, else `param_dtype`.

    Raises:
        ValueError: unknown dtype, a name produced twice, or a recipe that does not tile its
            destination.
    """
    dtypes = dict(dtypes or {})
    for name, dtype in [("param_dtype", param_dtype), *dtypes.items()]:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {dtype!r} for {name!r} is not one of {sorted(DTYPE_SIZES)}")
    specs: list[TensorSpec] = []
    seen: set[str] = set()

    def add(spec: TensorSpec) -> None:
        if spec.name in seen:
            raise ValueError(f"engine tensor {spec.name!r} is produced twice")
        seen.add(spec.name)
        specs.append(spec)

    for recipe in recipes:
        shape = recipe_shape(recipe)
        if recipe.quant is None:
            add(TensorSpec(recipe.dest, shape, dtypes.get(recipe.dest, param_dtype)))
        else:
            add(TensorSpec(recipe.dest, shape, FP8_DTYPE))
            add(
                TensorSpec(
                    recipe.quant.scale_dest, scale_shape(shape, recipe.quant.block), SCALE_DTYPE
                )
            )
    return tuple(specs)
