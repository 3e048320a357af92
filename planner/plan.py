"""The planner: source and destination manifests in, a static, balanced schedule out.

Pure and deterministic: no I/O, no clocks, no torch.distributed. The same manifests and config
give the same `Schedule`, byte for byte in its canonical JSON.

How a schedule is made:
1. Validate everything and collect every problem (missing, extra or duplicate tensors, a
   trainer tensor whose global shape or dtype is not the one its recipes declare in
   `Recipe.sources`, recipes that do not cover their destination exactly once) into one
   `PlanMismatchError`, before any byte moves. Aliases (tied parameters) name one source.
2. Turn recipes into work. A copy recipe (no transform) becomes "direct" writes: each part is
   cut along the trainer shards it spans, and each piece is sent by a rank that holds it in its
   own shard, so no rank gathers anything and there is no rank-0 funnel. An FP8 recipe needs
   whole 128x128 blocks of the fused, sharded destination. A unit (one expert, one tensor-
   parallel slice) that lies in one rank's shards is quantized there; one whose shards split
   it on block rows (FSDP's dim-0 chunks of 128-row multiples) is cut into bands, each
   quantized by the rank holding its rows (`PlannerConfig.quantize_in_shards`). Any other
   unit's sources are rebuilt with `full_tensor()` on their mesh ("gather" tasks);
   destinations that share the same sources share one gather, and the quantize-and-write
   units of a gather are spread over the mesh.
3. Balance: work is assigned largest first to the least-loaded rank that can send it.
4. Order: gather tasks of one mesh appear in the same order on every rank of that mesh; meshes
   that share no rank form a mesh group and run in parallel; groups follow each other with a
   barrier. Each task carries the temporary memory it needs.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import msgpack

from weight_transfer.errors import PlanMismatchError
from weight_transfer.planner import codec
from weight_transfer.planner.types import (
    DTYPE_SIZES,
    FLOAT_DTYPES,
    Box,
    DestManifest,
    DestTensor,
    Part,
    QuantWrite,
    RankSchedule,
    Recipe,
    Schedule,
    SliceWrite,
    SourceManifest,
    SourceSpec,
    Task,
    WriteRun,
    box_in,
    box_intersection,
    box_shape,
    dtype_size,
    numel,
    squeeze_shape,
    staging_key,
)

FORMAT_VERSION = 1
FP8_DTYPE = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """Knobs of the planner."""

    memory_budget_bytes: int = 1 << 30
    """Temporary memory per trainer rank (staging + scratch) that tasks in flight may use. The
    one memory budget of a transfer: the schedule carries it, and every trainer rank's executor
    runs within it (half a registered staging arena, half scratch)."""
    max_write_bytes: int | None = None
    """Largest single direct write; larger pieces are split so the pipeline can overlap them.
    None (default): 64 MiB, or a quarter of `memory_budget_bytes` if that is smaller."""
    task_target_bytes: int = 16 << 20
    """Small direct writes of one rank are batched into tasks of about this size."""
    allow_unused_sources: bool = False
    """If False, a trainer tensor that no recipe reads is an error (catches renames)."""
    allow_source_padding: bool = False
    """If True, a trainer tensor may be larger than its recipes expect along the dimensions
    they mark as padding (`SourceSpec.padded_dims`: the vLLM preset marks the vocabulary rows
    of embeddings and LM heads), and its trailing padding is never sent. Off: every trainer
    tensor must have exactly the shape its recipes declare."""
    quantize_in_shards: bool = True
    """FP8 units whose trainer shards split them on block rows are quantized by the ranks
    holding those rows, from their own shards, with no `full_tensor()` (an expert's 2,048 rows
    over 8 FSDP ranks: 256 rows, two 128-row blocks, each). Same bytes as a gathered unit. Off:
    every FP8 unit that spans ranks is gathered on its mesh."""

    def __post_init__(self) -> None:
        if self.memory_budget_bytes <= 0:
            raise ValueError("memory_budget_bytes must be positive")
        if self.max_write_bytes is not None and self.max_write_bytes <= 0:
            raise ValueError("max_write_bytes must be positive")
        if self.task_target_bytes <= 0:
            raise ValueError("task_target_bytes must be positive")
        if self.write_limit_bytes > self.memory_budget_bytes // 2:
            raise ValueError(
                "max_write_bytes must be at most half of memory_budget_bytes "
                f"({self.write_limit_bytes} > {self.memory_budget_bytes // 2})"
            )

    @property
    def write_limit_bytes(self) -> int:
        """`max_write_bytes`, or its default for this budget."""
        if self.max_write_bytes is not None:
            return self.max_write_bytes
        return max(1, min(64 << 20, self.memory_budget_bytes // 4))


_Holder = tuple[int, Box | None, tuple[int, ...], bool]
"""One trainer rank's shard of a source tensor: (rank, local box, mesh, offloaded). A plain
tuple: there are 10^6 of them at trainer scale."""
# Final int constants are Literal types, so mypy knows which tuple field each index picks.
RANK: Final = 0
LOCAL_BOX: Final = 1
MESH: Final = 2
OFFLOADED: Final = 3


_new = object.__new__
_QW = tuple(getattr(QuantWrite, f.name).__set__ for f in dataclasses.fields(QuantWrite))
_RUN = tuple(getattr(WriteRun, f.name).__set__ for f in dataclasses.fields(WriteRun))
_PART = tuple(getattr(Part, f.name).__set__ for f in dataclasses.fields(Part))


def _write_run(
    region: int,
    offset_bytes: int,
    nbytes: int,
    _s: tuple[Callable[[object, object], None], ...] = _RUN,
) -> WriteRun:
    """`WriteRun(...)` built through its slots, as `_quant_write`."""
    r = _new(WriteRun)
    _s[0](r, region)
    _s[1](r, offset_bytes)
    _s[2](r, nbytes)
    return r


def _part(
    source: str,
    source_box: Box,
    dest_box: Box,
    _s: tuple[Callable[[object, object], None], ...] = _PART,
) -> Part:
    """`Part(...)` built through its slots, as `_quant_write`."""
    p = _new(Part)
    _s[0](p, source)
    _s[1](p, source_box)
    _s[2](p, dest_box)
    return p


_SW = tuple(getattr(SliceWrite, f.name).__set__ for f in dataclasses.fields(SliceWrite))


def _quant_write(
    engine: str,
    dest: str,
    scale_dest: str,
    block: tuple[int, int],
    parts: tuple[Part, ...],
    dest_box: Box,
    scale_box: Box,
    weight_runs: tuple[WriteRun, ...],
    scale_runs: tuple[WriteRun, ...],
    _s: tuple[Callable[[object, object], None], ...] = _QW,
) -> QuantWrite:
    """`QuantWrite(...)`, built through its slots: the generated frozen `__init__` costs 2.5x
    more, and Kimi-K2's plan makes 2.2 M of them. The result is an ordinary `QuantWrite`."""
    w = _new(QuantWrite)
    _s[0](w, engine)
    _s[1](w, dest)
    _s[2](w, scale_dest)
    _s[3](w, block)
    _s[4](w, parts)
    _s[5](w, dest_box)
    _s[6](w, scale_box)
    _s[7](w, weight_runs)
    _s[8](w, scale_runs)
    return w


def _slice_write(
    engine: str,
    dest: str,
    source: str,
    source_box: Box,
    dest_box: Box,
    dtype: str,
    runs: tuple[WriteRun, ...],
    zero_copy: bool,
    _s: tuple[Callable[[object, object], None], ...] = _SW,
) -> SliceWrite:
    """`SliceWrite(...)` built through its slots, as `_quant_write`."""
    w = _new(SliceWrite)
    _s[0](w, engine)
    _s[1](w, dest)
    _s[2](w, source)
    _s[3](w, source_box)
    _s[4](w, dest_box)
    _s[5](w, dtype)
    _s[6](w, runs)
    _s[7](w, zero_copy)
    return w


@dataclasses.dataclass(slots=True)
class _Source:
    name: str
    shape: tuple[int, ...]
    dtype: str
    holders: list[_Holder]
    # Holders grouped by local box (replicas share a box): lookups scan distinct boxes only.
    _by_box: dict[Box, tuple[_Holder, ...]] | None = None
    _max_shard: int = -1
    _sig: int = -1

    def sig(self, interned: dict[tuple[object, ...], int]) -> int:
        """A small int naming how this tensor is sharded (each local box and the ranks holding
        it): tensors with equal signatures are cut into equal pieces and bands, so geometry
        computed for one (an expert of one layer) serves all (the same expert of every layer)."""
        if self._sig < 0:
            shape = tuple(
                sorted((b, tuple(sorted(h[RANK] for h in hs))) for b, hs in self.by_box().items())
            )
            self._sig = interned.setdefault(shape, len(interned))
        return self._sig

    def max_shard_numel(self) -> int:
        """Elements of the largest local shard (0 when no shard is a box)."""
        if self._max_shard < 0:
            self._max_shard = max(
                (math.prod([c - a for a, c in b]) for b in self.by_box()), default=0
            )
        return self._max_shard

    def by_box(self) -> dict[Box, tuple[_Holder, ...]]:
        if self._by_box is None:
            # Group by the identity of box tuples first (cheap), then merge equal boxes.
            by_id: dict[int, list[_Holder]] = {}
            for h in self.holders:
                lb = h[LOCAL_BOX]
                if lb is not None:
                    got = by_id.get(id(lb))
                    if got is None:
                        by_id[id(lb)] = [h]
                    else:
                        got.append(h)
            groups: dict[Box, list[_Holder]] = {}
            for hs in by_id.values():
                box = hs[0][LOCAL_BOX]
                assert box is not None
                if box in groups:
                    groups[box] = sorted(groups[box] + hs, key=lambda h: h[RANK])
                else:
                    groups[box] = hs
            self._by_box = {b: tuple(hs) for b, hs in groups.items()}
        return self._by_box


# ---------------------------------------------------------------------------------------------
# Geometry helpers
# ---------------------------------------------------------------------------------------------


def dest_runs(
    shape: tuple[int, ...], box: Box, itemsize: int, base_offset: int, region: int
) -> tuple[WriteRun, ...]:
    """Contiguous byte runs of `box` inside a row-major tensor of `shape` at `base_offset`.

    Runs follow the row-major order of the box, merged where they touch.
    """
    ndim = len(shape)
    if ndim == 0:
        return (WriteRun(region, base_offset, itemsize),)
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # The innermost dims the box spans fully form one contiguous block with the first partial one.
    k = ndim - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    block_elems = (box[k][1] - box[k][0]) * strides[k]
    outer = [range(a, b) for a, b in box[:k]]
    runs: list[WriteRun] = []
    idx = [a for a, _ in box[:k]]
    count = numel(tuple(len(r) for r in outer)) if outer else 1
    for _ in range(count):
        start = sum(i * s for i, s in zip(idx, strides[:k], strict=True)) + box[k][0] * strides[k]
        off = base_offset + start * itemsize
        nbytes = block_elems * itemsize
        if runs and runs[-1].offset_bytes + runs[-1].nbytes == off:
            last = runs[-1]
            runs[-1] = WriteRun(region, last.offset_bytes, last.nbytes + nbytes)
        else:
            runs.append(WriteRun(region, off, nbytes))
        for d in range(k - 1, -1, -1):
            idx[d] += 1
            if idx[d] < box[d][1]:
                break
            idx[d] = box[d][0]
    return tuple(runs)


def is_contiguous_box(shape: tuple[int, ...], box: Box) -> bool:
    """True if `box` is one contiguous byte range of a row-major tensor of `shape`."""
    ndim = len(shape)
    d = 0
    while d < ndim and box[d][1] - box[d][0] == 1:
        d += 1
    return all(box[j] == (0, shape[j]) for j in range(d + 1, ndim))


def map_subbox(part: Part, sub: Box) -> Box:
    """Map a sub-box of `part.source_box` to the matching sub-box of `part.dest_box`."""
    sdims = [d for d, (a, b) in enumerate(part.source_box) if b - a != 1]
    ddims = [d for d, (a, b) in enumerate(part.dest_box) if b - a != 1]
    out = list(part.dest_box)
    for sd, dd in zip(sdims, ddims, strict=True):
        delta0 = sub[sd][0] - part.source_box[sd][0]
        out[dd] = (
            part.dest_box[dd][0] + delta0,
            part.dest_box[dd][0] + delta0 + sub[sd][1] - sub[sd][0],
        )
    return tuple(out)


def _clip_part_to_dest(part: Part, dest_box: Box) -> Part | None:
    """Restrict a part to the piece landing inside `dest_box`."""
    inter = box_intersection(part.dest_box, dest_box)
    if inter is None:
        return None
    sdims = [d for d, (a, b) in enumerate(part.source_box) if b - a != 1]
    ddims = [d for d, (a, b) in enumerate(part.dest_box) if b - a != 1]
    src = list(part.source_box)
    for sd, dd in zip(sdims, ddims, strict=True):
        delta0 = inter[dd][0] - part.dest_box[dd][0]
        src[sd] = (
            part.source_box[sd][0] + delta0,
            part.source_box[sd][0] + delta0 + inter[dd][1] - inter[dd][0],
        )
    return Part(part.source, tuple(src), inter)


def _split_box(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Split a box along its first non-unit dim into pieces of at most `max_bytes` (if possible)."""
    shape = box_shape(box)
    total = numel(shape) * itemsize
    if total <= max_bytes:
        return [box]
    d = next((i for i, n in enumerate(shape) if n > 1), None)
    if d is None:
        return [box]
    row_bytes = total // shape[d]
    rows = max(1, max_bytes // row_bytes)
    out = []
    a, b = box[d]
    for s in range(a, b, rows):
        nb = list(box)
        nb[d] = (s, min(b, s + rows))
        out.append(tuple(nb))
    return out


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _box_fits(box: Box, shape: tuple[int, ...]) -> bool:
    return (
        len(box) == len(shape)
        and box_in(box, tuple((0, n) for n in shape))
        and all(a <= b for a, b in box)
    )


def _collect_sources(
    sources: Sequence[SourceManifest], problems: list[str], alias_of: dict[str, str]
) -> dict[str, _Source]:
    """The source table by name; fills `alias_of` (alias -> the name its tensor is listed by)."""
    table: dict[str, _Source] = {}
    ranks = sorted(m.rank for m in sources)
    world = {m.world_size for m in sources}
    if len(world) > 1:
        problems.append(f"trainer ranks disagree on world_size: {sorted(world)}")
    if sources and ranks != list(range(sources[0].world_size)):
        problems.append(
            f"expected one source manifest per trainer rank 0..{sources[0].world_size - 1}, "
            f"got ranks {ranks}"
        )
    # 10^6 entries at trainer scale: checks of a box or a mesh are memoised by the identity of
    # the tuple (the manifests keep them alive and presets share them), so each distinct object
    # is checked once per shape; decoded manifests simply miss the memo.
    box_ok: dict[int, tuple[int, ...]] = {}  # id(box) -> a shape it fits
    fields = operator.attrgetter(
        "name", "shape", "dtype", "local_box", "mesh", "offloaded", "aliases"
    )
    for m in sorted(sources, key=lambda m: m.rank):
        if _collect_fast(m, table, box_ok, problems):
            continue
        rank = m.rank
        seen: set[str] = set()
        mesh_ok: dict[int, bool] = {}
        for name, shape, dtype, lb, mesh, off, aliases in map(fields, m.tensors):
            if name in seen:
                problems.append(f"trainer rank {rank}: duplicate tensor name {name!r}")
                continue
            seen.add(name)
            for alias in aliases:
                other = alias_of.setdefault(alias, name)
                if other != name:
                    problems.append(
                        f"trainer rank {rank}: {alias!r} is an alias of {name!r}, but another "
                        f"rank lists it as an alias of {other!r}"
                    )
            if dtype not in DTYPE_SIZES:
                problems.append(
                    f"trainer rank {rank}: tensor {name!r} has unsupported dtype {dtype!r}"
                )
                continue
            if lb is not None and box_ok.get(id(lb)) != shape:
                if _box_fits(lb, shape):
                    box_ok[id(lb)] = shape
                else:
                    problems.append(
                        f"trainer rank {rank}: tensor {name!r} local shard {lb} "
                        f"does not fit its global shape {shape}"
                    )
                    continue
            ok = mesh_ok.get(id(mesh))
            if ok is None:
                ok = mesh_ok[id(mesh)] = rank in mesh
            if not ok:
                problems.append(
                    f"trainer rank {rank}: tensor {name!r} mesh {mesh} does not contain the rank"
                )
                continue
            src = table.get(name)
            if src is None:
                src = table[name] = _Source(name, tuple(shape), dtype, [])
            elif (src.shape is not shape and src.shape != shape) or src.dtype != dtype:
                problems.append(
                    f"tensor {name!r}: trainer ranks disagree on shape/dtype "
                    f"({src.shape}/{src.dtype} vs rank {rank}: {tuple(shape)}/{dtype})"
                )
                continue
            src.holders.append((rank, lb, mesh, off))
    for alias, name in sorted(alias_of.items()):
        if alias in table:
            problems.append(
                f"trainer tensor {alias!r} is listed both as a tensor and as an alias of {name!r}"
            )
    covered_memo: dict[tuple[Box, ...], int] = {}
    mesh_of, box_of = operator.itemgetter(MESH), operator.itemgetter(LOCAL_BOX)
    for src in table.values():
        holders = src.holders
        meshes = list(map(mesh_of, holders))
        ids = list(map(id, meshes))
        objs = dict(zip(ids, meshes, strict=True))
        if len(objs) == 1:
            # One mesh object (a plain FSDP tensor): every rank of it holds the tensor once
            # (names are unique per rank and each rank is in its mesh), so the count decides.
            mesh = meshes[0]
            if len(mesh) == 1 or len(holders) == len(mesh):
                if None not in map(box_of, holders):
                    _check_coverage(src, covered_memo, problems)
                continue
        # Group by the identity of mesh tuples first (cheap), then merge equal meshes.
        by_mesh_id: dict[int, tuple[tuple[int, ...], list[int]]] = {}
        has_none = False
        for rank, lb, mesh, _ in holders:
            if lb is None:
                has_none = True
            got = by_mesh_id.get(id(mesh))
            if got is None:
                by_mesh_id[id(mesh)] = (mesh, [rank])
            else:
                got[1].append(rank)
        by_mesh: dict[tuple[int, ...], set[int]] = defaultdict(set)
        for mesh, rs in by_mesh_id.values():
            if len(mesh) > 1:
                by_mesh[mesh].update(rs)
        for mesh, have in by_mesh.items():
            if len(have) != len(mesh) or have != set(mesh):
                problems.append(
                    f"tensor {src.name!r}: mesh {mesh} is missing rank(s) "
                    f"{sorted(set(mesh) - have)}"
                )
        if not has_none:
            _check_coverage(src, covered_memo, problems)
    return table


def _check_coverage(
    src: _Source, covered_memo: dict[tuple[Box, ...], int], problems: list[str]
) -> None:
    """Report a tensor whose shards (all boxes) do not cover it."""
    # Tensors of one shape sharded alike share their boxes: compute coverage once.
    distinct = tuple(sorted(src.by_box()))
    covered = covered_memo.get(distinct, -1)
    if covered < 0:
        covered = covered_memo[distinct] = _union_volume(distinct)
    if covered < numel(src.shape):
        problems.append(
            f"tensor {src.name!r}: trainer shards cover {covered} of {numel(src.shape)} elements"
        )


_NAME = operator.attrgetter("name")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_BOX = operator.attrgetter("local_box")
_MESH = operator.attrgetter("mesh")
_OFFLOADED = operator.attrgetter("offloaded")
_ALIASES = operator.attrgetter("aliases")


def _collect_fast(
    m: SourceManifest,
    table: dict[str, _Source],
    box_ok: dict[int, tuple[int, ...]],
    problems: list[str],
) -> bool:
    """`_collect_sources`'s per-entry loop for one manifest, column by column: names, dtypes,
    boxes and meshes are checked in bulk (each distinct box and mesh object once), then the
    entries are filed. Returns False, having filed nothing, when the manifest has duplicate
    names, aliases, an unknown dtype, a box that does not fit or a mesh without the rank: the
    entry-by-entry loop then reports each problem."""
    ts = m.tensors
    names = list(map(_NAME, ts))
    if len(set(names)) != len(names) or any(map(_ALIASES, ts)):
        return False
    dtypes = list(map(_DTYPE, ts))
    if not DTYPE_SIZES.keys() >= set(dtypes):
        return False
    rank = m.rank
    meshes = list(map(_MESH, ts))
    if not all(rank in mesh for mesh in dict(zip(map(id, meshes), meshes, strict=True)).values()):
        return False
    shapes = list(map(_SHAPE, ts))
    boxes = list(map(_BOX, ts))
    pairs = dict(
        zip(
            zip(map(id, boxes), map(id, shapes), strict=True),
            zip(boxes, shapes, strict=True),
            strict=True,
        )
    )
    for lb, shape in pairs.values():
        if lb is None or box_ok.get(id(lb)) == shape:
            continue
        if not _box_fits(lb, shape):
            return False
        box_ok[id(lb)] = shape
    get = table.get
    # The holder tuples are made by zip, in C.
    holders = zip(itertools.repeat(rank), boxes, meshes, map(_OFFLOADED, ts), strict=False)
    for name, shape, dtype, holder in zip(names, shapes, dtypes, holders, strict=True):
        src = get(name)
        if src is None:
            src = table[name] = _Source(name, tuple(shape), dtype, [holder])
        elif (src.shape is not shape and src.shape != shape) or src.dtype != dtype:
            problems.append(
                f"tensor {name!r}: trainer ranks disagree on shape/dtype "
                f"({src.shape}/{src.dtype} vs rank {rank}: {tuple(shape)}/{dtype})"
            )
        else:
            src.holders.append(holder)
    return True


def _union_volume(boxes: Iterable[Box]) -> int:
    distinct = sorted(set(b for b in boxes if all(x < y for x, y in b)))
    if _pairwise_disjoint(distinct):
        return sum(numel(box_shape(b)) for b in distinct)
    # Overlapping shards (replicas): count via the largest disjoint family is not needed for the
    # coverage check; a box that contains all others is enough.
    total = 0
    kept: list[Box] = []
    for b in sorted(distinct, key=lambda b: -numel(box_shape(b))):
        if not any(box_in(b, k) for k in kept):
            kept.append(b)
    for b in kept:
        total += numel(box_shape(b))
    return total


def _pairwise_disjoint(boxes: Sequence[Box]) -> bool:
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if box_intersection(boxes[i], boxes[j]) is not None:
                return False
    return True


def _check_parts_cover(recipe: Recipe, dest: DestTensor) -> str | None:
    full = numel(dest.shape)
    total = 0
    boxes = []
    for p in recipe.parts:
        if len(p.dest_box) != len(dest.shape) or not box_in(
            p.dest_box, tuple((0, n) for n in dest.shape)
        ):
            return f"part from {p.source!r} box {p.dest_box} lies outside shape {dest.shape}"
        total += numel(box_shape(p.dest_box))
        boxes.append(p.dest_box)
    if total != full:
        return f"parts cover {total} elements of {full}"
    # Equal volume and no overlap means exact cover. Sort to find overlaps among neighbours fast.
    boxes.sort()
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if boxes[j][0][0] >= boxes[i][0][1]:
                break
            if box_intersection(boxes[i], boxes[j]) is not None:
                return f"parts overlap at {boxes[i]} and {boxes[j]}"
    return None


def _spec_mismatch(spec: SourceSpec, src: _Source, allow_padding: bool) -> str | None:
    """Why trainer tensor `src` is not what `spec` expects, or None when it is."""
    if spec.dtype is not None and src.dtype != spec.dtype:
        return f"dtype {spec.dtype}"
    if src.shape == spec.shape:
        return None
    padded = (
        allow_padding
        and bool(spec.padded_dims)
        and len(src.shape) == len(spec.shape)
        and all(
            got >= want if d in spec.padded_dims else got == want
            for d, (got, want) in enumerate(zip(src.shape, spec.shape, strict=True))
        )
    )
    return None if padded else f"shape {spec.shape}"


_Mismatch = tuple[str, str, str, bool]
"""(trainer tensor, what a recipe expects, what the trainer has, whether
`PlannerConfig.allow_source_padding` would accept it)."""


def _report_mismatches(
    mismatches: dict[_Mismatch, list[tuple[str, str]]], problems: list[str]
) -> None:
    """One line per trainer tensor and expectation, naming the first engine recipe reading it."""
    for (name, want, have, padding_would_do), readers in sorted(mismatches.items()):
        engine, dest = readers[0]
        more = f" (and {len(readers) - 1} more engine recipe(s))" if len(readers) > 1 else ""
        hint = (
            "; if the extra rows are the trainer's padding, set PlannerConfig.allow_source_padding"
            if padding_would_do
            else ""
        )
        problems.append(
            f"trainer tensor {name!r} is {have}, but engine {engine!r} reads it for {dest!r} "
            f"as {want}{more}{hint}"
        )


def _check_placement(d: DestManifest, problems: list[str]) -> dict[str, DestTensor]:
    """Check where an engine's tensors sit (regions, the version word, each tensor inside its
    region); returns its tensors by name."""
    regions = {r.index: r for r in d.regions}
    if len(regions) != len(d.regions):
        problems.append(f"engine {d.engine!r}: duplicate region indices")
    vr = regions.get(d.version_region)
    if vr is None or vr.nbytes < 8:
        problems.append(
            f"engine {d.engine!r}: version region {d.version_region} missing or < 8 bytes"
        )
    tensors: dict[str, DestTensor] = {}
    for t in d.tensors:
        if t.name in tensors:
            problems.append(f"engine {d.engine!r}: duplicate tensor name {t.name!r}")
            continue
        tensors[t.name] = t
        try:
            size = numel(t.shape) * dtype_size(t.dtype)
        except ValueError:
            problems.append(
                f"engine {d.engine!r}: tensor {t.name!r} has unsupported dtype {t.dtype!r}"
            )
            continue
        r = regions.get(t.region)
        if r is None or t.offset_bytes < 0 or t.offset_bytes + size > r.nbytes:
            problems.append(
                f"engine {d.engine!r}: tensor {t.name!r} ({size} bytes at {t.offset_bytes}) "
                f"lies outside region {t.region}"
            )
    return tensors


def _validate_dests(
    dests: Sequence[DestManifest],
    sources: dict[str, _Source],
    problems: list[str],
    config: PlannerConfig,
) -> set[str]:
    used: set[str] = set()
    names = [d.engine for d in dests]
    for n in sorted(set(names)):
        if names.count(n) > 1:
            problems.append(f"engine {n!r} registered more than once")
    # Replicas share their tensor and recipe tuples: an identical layout that was valid once is
    # valid again (only the engine name, which no check reads, differs).
    valid_layouts: set[tuple[object, ...]] = set()
    mismatches: dict[_Mismatch, list[tuple[str, str]]] = {}
    pad = config.allow_source_padding
    for d in dests:
        layout = (
            id(d.tensors),
            id(d.recipes),
            tuple((r.index, r.nbytes) for r in d.regions),
            d.version_region,
        )
        if layout in valid_layouts:
            continue
        num_problems = len(problems)
        mismatched = False
        tensors = _check_placement(d, problems)
        recipes: dict[str, Recipe] = {}
        written: set[str] = set()
        for rc in d.recipes:
            if rc.dest in recipes:
                problems.append(f"engine {d.engine!r}: two recipes for {rc.dest!r}")
                continue
            recipes[rc.dest] = rc
            dt = tensors.get(rc.dest)
            if dt is None:
                problems.append(
                    f"engine {d.engine!r}: recipe for unknown engine tensor {rc.dest!r}"
                )
                continue
            written.add(rc.dest)
            bad = False
            declared = {spec.name for spec in rc.sources}
            wrong: set[str] = set()  # sources not as declared: their parts are not checked
            for spec in rc.sources:
                s = sources.get(spec.name)
                if s is None:
                    continue  # reported below, by the part that reads it
                what = _spec_mismatch(spec, s, pad)
                if what is not None:
                    have = f"dtype {s.dtype}" if what.startswith("dtype") else f"shape {s.shape}"
                    fix = not pad and _spec_mismatch(spec, s, True) is None
                    mismatches.setdefault((spec.name, what, have, fix), []).append(
                        (d.engine, rc.dest)
                    )
                    wrong.add(spec.name)
                    bad = mismatched = True
            for p in rc.parts:
                s = sources.get(p.source)
                if s is None:
                    problems.append(
                        f"engine {d.engine!r}: {rc.dest!r} needs trainer tensor {p.source!r}, "
                        "which no trainer rank has"
                    )
                    bad = True
                    continue
                used.add(p.source)
                if p.source in wrong:
                    continue
                if p.source not in declared:
                    problems.append(
                        f"engine {d.engine!r}: recipe for {rc.dest!r} reads trainer tensor "
                        f"{p.source!r} but does not declare its shape (Recipe.sources; the "
                        "builders in planner.recipes fill it)"
                    )
                    bad = True
                    continue
                if len(p.source_box) != len(s.shape) or not box_in(
                    p.source_box, tuple((0, n) for n in s.shape)
                ):
                    problems.append(
                        f"engine {d.engine!r}: {rc.dest!r} reads {p.source!r}{list(p.source_box)} "
                        f"outside its shape {s.shape}"
                    )
                    bad = True
                elif squeeze_shape(box_shape(p.source_box)) != squeeze_shape(box_shape(p.dest_box)):
                    problems.append(
                        f"engine {d.engine!r}: {rc.dest!r} part from {p.source!r} has shape "
                        f"{box_shape(p.source_box)} but lands in {box_shape(p.dest_box)}"
                    )
                    bad = True
                if (
                    rc.quant is None
                    and s.dtype != dt.dtype
                    and not (s.dtype in FLOAT_DTYPES and dt.dtype in FLOAT_DTYPES)
                ):
                    problems.append(
                        f"engine {d.engine!r}: {rc.dest!r} is {dt.dtype} but {p.source!r} is "
                        f"{s.dtype}, and no recipe transform explains it"
                    )
                    bad = True
                if rc.quant is not None and s.dtype not in FLOAT_DTYPES:
                    problems.append(
                        f"engine {d.engine!r}: cannot FP8-quantize {p.source!r} of dtype {s.dtype}"
                    )
                    bad = True
            if not bad:
                why = _check_parts_cover(rc, dt)
                if why:
                    problems.append(f"engine {d.engine!r}: recipe for {rc.dest!r}: {why}")
            if rc.quant is not None:
                if dt.dtype != FP8_DTYPE:
                    problems.append(
                        f"engine {d.engine!r}: {rc.dest!r} has an FP8 recipe but dtype {dt.dtype}"
                    )
                st = tensors.get(rc.quant.scale_dest)
                if len(dt.shape) < 2:
                    problems.append(
                        f"engine {d.engine!r}: FP8 tensor {rc.dest!r} must have >= 2 dims"
                    )
                elif st is None:
                    problems.append(
                        f"engine {d.engine!r}: scale tensor {rc.quant.scale_dest!r} of "
                        f"{rc.dest!r} is missing"
                    )
                else:
                    b0, b1 = rc.quant.block
                    *lead, rows, cols = dt.shape
                    want = (*lead, -(-rows // b0), -(-cols // b1))
                    if st.shape != want or st.dtype != "float32":
                        problems.append(
                            f"engine {d.engine!r}: scale tensor {st.name!r} is "
                            f"{st.shape}/{st.dtype}, "
                            f"expected {want}/float32"
                        )
                    written.add(st.name)
            elif dt.dtype == FP8_DTYPE:
                problems.append(
                    f"engine {d.engine!r}: {rc.dest!r} is float8_e4m3fn but its recipe has no "
                    "FP8 transform"
                )
        for name in sorted(set(tensors) - written):
            problems.append(f"engine {d.engine!r}: engine tensor {name!r} has no recipe")
        if len(problems) == num_problems and not mismatched:
            valid_layouts.add(layout)
    _report_mismatches(mismatches, problems)
    return used


# ---------------------------------------------------------------------------------------------
# Work items
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Piece:
    """A direct write's geometry, shared by every engine whose recipe places it alike."""

    source: str
    source_box: Box
    dest_box: Box
    runs: tuple[WriteRun, ...]
    nbytes: int
    candidates: tuple[int, ...]  # ranks holding the piece in their own shard (sorted)
    boxes: dict[int, Box]  # rank -> its local box of the source (for zero-copy)
    offloaded: dict[int, bool]
    src_itemsize: int
    any_offloaded: bool


@dataclasses.dataclass(slots=True)
class _QuantUnit:
    """One quantize-and-write unit of an FP8 recipe, shared by engines placing it alike."""

    dest_box: Box
    scale_box: Box
    parts: tuple[Part, ...]
    sources: tuple[str, ...]
    weight_runs: tuple[WriteRun, ...]
    scale_runs: tuple[WriteRun, ...]
    local: tuple[int, ...]  # ranks holding every part in their own shard (no collective)
    nbytes: int
    numel: int  # elements of dest_box (the float32 assembly buffer)


_GatherKey = tuple[tuple[int, ...], tuple[str, ...]]
_Unit = tuple[SliceWrite | QuantWrite, int, int]  # a write, its bytes, its elements


@dataclasses.dataclass(slots=True)
class _Gather:
    mesh: tuple[int, ...]
    sources: tuple[str, ...]
    scratch_bytes: int
    by_rank: dict[int, list[SliceWrite | QuantWrite]]  # assigned writes per rank
    staging: dict[int, int]  # their staging bytes per rank (engine replicas' copies once)
    wire: dict[int, int]  # their bytes on the wire per rank
    local: bool  # one rank holds all needed data locally: no collective
    seq: int  # position of the gather's first unit in the engines' recipe order


@dataclasses.dataclass(slots=True)
class _LocalGather:
    """Units one rank quantizes from its own shards, for one source set: no collective.

    Kimi-K2's plan has about 600k of these (a rank's band of each expert weight), so they
    carry plain fields rather than a `_Gather`'s per-rank dicts."""

    rank: int
    mesh: tuple[int, ...]  # (rank,)
    sources: tuple[str, ...]
    scratch_bytes: int
    writes: list[SliceWrite | QuantWrite]
    staging: int  # each distinct staged unit once (engine replicas' copies share it)
    wire: int
    seq: int
    stamps: list[_Layout]
    """Layouts whose single-holder units of this key are written to each of their engines:
    those writes come first (engines in name order), then `writes`."""

    def all_writes(self) -> list[SliceWrite | QuantWrite]:
        """This gather's writes, the stamped ones made now."""
        key = (self.mesh, self.sources)
        if not self.stamps:
            return self.writes
        if len(self.stamps) == 1:
            lay = self.stamps[0]
            entries = lay.singles[key]
            out: list[SliceWrite | QuantWrite] = [
                _quant_write(e, *args) for e in lay.engines for args, _, _ in entries
            ]
        else:
            by_engine = sorted((e, i) for i, lay in enumerate(self.stamps) for e in lay.engines)
            out = [
                _quant_write(e, *args)
                for e, i in by_engine
                for args, _, _ in self.stamps[i].singles[key]
            ]
        out.extend(self.writes)
        return out


def _distinct_staging(units: Sequence[_Unit]) -> int:
    """Bytes of the distinct `staging_key`s among `units` (each key counted once).

    Quant writes that share their `parts` tuple object are engine replicas' copies of one unit
    (same parts, boxes and block, so equal keys): their key is computed once, not per copy."""
    first = units[0][0]
    if type(first) is QuantWrite:
        parts = first.parts
        if all(type(w) is QuantWrite and w.parts is parts for w, _, _ in units):
            return units[0][1]  # one unit, written to each engine replica
    seen: set[int] = set()
    reps: list[tuple[SliceWrite | QuantWrite, int]] = []
    for w, nb, _ in units:
        if type(w) is QuantWrite:
            k = id(w.parts)
            if k in seen:
                continue
            seen.add(k)
        reps.append((w, nb))
    return sum({staging_key(w): nb for w, nb in reps}.values())


@dataclasses.dataclass(slots=True)
class _LocalBatch:
    """Local quantization units of one rank being batched into one task."""

    group: int
    names: list[str]
    writes: list[SliceWrite | QuantWrite]
    staging: int
    wire: int
    scratch: int


def _pieces(part: Part, src: _Source) -> list[tuple[Box, tuple[_Holder, ...]]] | None:
    """Cut a part's source box along trainer shards; None if it needs a gather."""
    groups = src.by_box()
    containing = [h for b, hs in groups.items() if box_in(part.source_box, b) for h in hs]
    if containing:
        containing.sort(key=lambda h: h[RANK])
        return [(part.source_box, tuple(containing))]
    by_box = {b: hs for b, hs in groups.items() if box_intersection(part.source_box, b) is not None}
    boxes = sorted(by_box)
    if not _pairwise_disjoint(boxes):
        return None
    out = []
    covered = 0
    for b in boxes:
        inter = box_intersection(part.source_box, b)
        assert inter is not None
        covered += numel(box_shape(inter))
        out.append((inter, tuple(by_box[b])))
    if covered != numel(box_shape(part.source_box)):
        return None
    return out


def _direct_template(
    rc: Recipe,
    dt: DestTensor,
    table: dict[str, _Source],
    config: PlannerConfig,
    problems: list[str],
) -> tuple[list[_Piece], list[tuple[tuple[int, ...], Part, tuple[WriteRun, ...], int]]]:
    """A copy recipe's direct pieces, and the parts whose shards are not boxes (gather, then
    copy) as (mesh, part, runs, bytes)."""
    out_size = dtype_size(dt.dtype)
    pieces: list[_Piece] = []
    gathered: list[tuple[tuple[int, ...], Part, tuple[WriteRun, ...], int]] = []
    for p in rc.parts:
        src = table[p.source]
        cut = _pieces(p, src)
        if cut is None:
            mesh = _gather_mesh(src, problems)
            if mesh is not None:
                runs = dest_runs(dt.shape, p.dest_box, out_size, dt.offset_bytes, dt.region)
                gathered.append((mesh, p, runs, sum(r.nbytes for r in runs)))
            continue
        isz = dtype_size(src.dtype)
        for piece, holders in cut:
            cands = tuple(sorted({h[RANK] for h in holders}))
            boxes = {h[RANK]: h[LOCAL_BOX] for h in holders if h[LOCAL_BOX]}
            offl = {h[RANK]: h[OFFLOADED] for h in holders}
            for chunk in _split_box(piece, max(out_size, isz), config.write_limit_bytes):
                dbox = map_subbox(p, chunk)
                runs = dest_runs(dt.shape, dbox, out_size, dt.offset_bytes, dt.region)
                pieces.append(
                    _Piece(
                        p.source,
                        chunk,
                        dbox,
                        runs,
                        sum(r.nbytes for r in runs),
                        cands,
                        boxes,
                        offl,
                        isz,
                        any(offl.values()),
                    )
                )
    return pieces, gathered


_DirectTemplate = tuple[list[_Piece], list[tuple[tuple[int, ...], Part, tuple[WriteRun, ...], int]]]


_QuantArgs = tuple[
    str,
    str,
    tuple[int, int],
    tuple[Part, ...],
    Box,
    Box,
    tuple[WriteRun, ...],
    tuple[WriteRun, ...],
]
"""A QuantWrite's fields after the engine name."""
_SingleEntry = tuple[_QuantArgs, int, int]
"""A single-holder unit of a layout: its QuantWrite's arguments after the engine name, its
bytes and its elements."""


@dataclasses.dataclass(slots=True)
class _Layout:
    """One engine layout's work, without the engine name."""

    directs: list[tuple[_Piece, str, str]]  # (piece, dest, dtype)
    copies: list[tuple[_GatherKey, Part, tuple[WriteRun, ...], int, str, str]]
    quants: list[tuple[_QuantUnit, str, str, tuple[int, int], int, tuple[str, ...] | None]]
    gather_seq: dict[_GatherKey, int]  # first recipe index using each copy gather
    pending_seq: dict[tuple[str, ...], int]
    # Units only one rank can quantize: the arguments of their QuantWrite after the engine
    # name, then their task key, bytes and elements (each engine only stamps its name).
    singles: dict[_GatherKey, list[_SingleEntry]] = dataclasses.field(default_factory=dict)
    single_seq: dict[_GatherKey, int] = dataclasses.field(default_factory=dict)
    engines: list[str] = dataclasses.field(default_factory=list)  # sorted: those using it
    single_load: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> bytes
    nbytes: int = 0  # every write of the layout


def _compile_layout(
    d: DestManifest,
    table: dict[str, _Source],
    config: PlannerConfig,
    problems: list[str],
    direct_by_id: dict[tuple[object, ...], _DirectTemplate],
    direct_by_value: dict[tuple[object, ...], _DirectTemplate],
    quant_by_id: dict[tuple[object, ...], _QuantUnits],
    quant_by_value: dict[tuple[object, ...], _QuantUnits],
    cands_of: dict[tuple[str, ...], list[tuple[int, ...]]],
    shard_memo: _ShardMemo,
) -> _Layout:
    """Write templates of one engine layout; a quant unit that is not local and whose sources
    share no mesh has no source set (the caller reports it per engine)."""
    lay = _Layout([], [], [], {}, {})
    tensors = {t.name: t for t in d.tensors}
    for seq, rc in enumerate(d.recipes):
        dt = tensors[rc.dest]
        if rc.quant is None:
            place: tuple[object, ...] = (dt.shape, dt.dtype, dt.region, dt.offset_bytes)
            tmpl = direct_by_id.get((id(rc), *place))
            if tmpl is None:
                tmpl = direct_by_value.get((rc, *place))
                if tmpl is None:
                    tmpl = direct_by_value[(rc, *place)] = _direct_template(
                        rc, dt, table, config, problems
                    )
                direct_by_id[(id(rc), *place)] = tmpl
            pieces, gathered = tmpl
            lay.directs.extend((pc, rc.dest, dt.dtype) for pc in pieces)
            lay.nbytes += sum(pc.nbytes for pc in pieces) + sum(g[3] for g in gathered)
            for mesh, p, runs, nbytes in gathered:
                key = (mesh, (p.source,))
                lay.gather_seq.setdefault(key, seq)
                lay.copies.append((key, p, runs, nbytes, rc.dest, dt.dtype))
            continue
        st = tensors[rc.quant.scale_dest]
        place = (dt.shape, dt.region, dt.offset_bytes, st.shape, st.region, st.offset_bytes)
        got = quant_by_id.get((id(rc), *place))
        if got is None:
            got = quant_by_value.get((rc, *place))
            if got is None:
                got = quant_by_value[(rc, *place)] = _quant_units_like(
                    rc, dt, st, table, bands=config.quantize_in_shards, memo=shard_memo
                )
            quant_by_id[(id(rc), *place)] = got
        singles, units = got
        # Units only one rank can quantize: their task key is known now.
        lay_singles, single_load = lay.singles, lay.single_load
        for skey, entry in singles:
            lst = lay_singles.get(skey)
            if lst is None:
                lay_singles[skey] = [entry]
                lay.single_seq[skey] = seq  # recipes come in order: the first is the least
            else:
                lst.append(entry)
            r = skey[0][0]
            single_load[r] = single_load.get(r, 0) + entry[1]
            lay.nbytes += entry[1]
        lay.nbytes += sum(u.nbytes for u in units)
        for u in units:
            names: tuple[str, ...] | None = None
            if u.local:
                names = u.sources
            else:
                cands = cands_of.get(u.sources)
                if cands is None:
                    cands = cands_of[u.sources] = _common_gather_meshes(
                        [table[n] for n in u.sources]
                    )
                if cands:
                    names = u.sources
                    lay.pending_seq.setdefault(names, seq)
            lay.quants.append((u, rc.dest, st.name, rc.quant.block, seq, names))
    return lay


def plan(
    sources: Sequence[SourceManifest],
    dests: Sequence[DestManifest],
    config: PlannerConfig | None = None,
) -> Schedule:
    """Compute the static schedule.

    Not thread-hostile but process-global in one respect: the cyclic garbage collector is paused
    while planning (planning builds 10^6 acyclic objects, and the collector's repeated scans of
    them cost a third of the time at trainer scale); it is resumed on return or error.

    Raises:
        PlanMismatchError: listing every problem found in the manifests.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(sources, dests, config or PlannerConfig())
    finally:
        if enabled:
            gc.enable()


def _plan(
    sources: Sequence[SourceManifest],
    dests: Sequence[DestManifest],
    config: PlannerConfig,
    source_hash: hashlib._Hash | None = None,
    fingerprint_memo: dict[int, tuple[object, bytes]] | None = None,
) -> Schedule:
    """The planning steps, in order; each raises `PlanMismatchError` with every problem found.

    `source_hash` (the `_hash_sources` state of `sources`, copied here) and `fingerprint_memo`
    let a caller that plans repeatedly for the same trainers skip re-hashing what it hashed."""
    table, resolved = _validate(sources, dests, config)
    p = _Planning(sources[0].world_size, sorted(d.engine for d in dests), table, config)
    p.compile_engines(resolved)
    p.balance_local_work()
    p.place_replicated_gathers()
    p.build_gathers()
    p.colour_mesh_groups()
    p.gather_tasks()
    p.direct_tasks()
    p.interleave()
    h = _hash_sources(sources) if source_hash is None else source_hash.copy()
    return p.schedule(_finish_fingerprint(h, dests, config, fingerprint_memo or {}))


def _validate(
    sources: Sequence[SourceManifest], dests: Sequence[DestManifest], config: PlannerConfig
) -> tuple[dict[str, _Source], Sequence[DestManifest]]:
    """The source table, once the manifests are complete and every source is read as its
    recipes declare, and the engine manifests with aliases resolved to the names sources are
    listed by."""
    problems: list[str] = []
    if not sources:
        problems.append("no trainer (source) manifests")
    if not dests:
        problems.append("no engine (destination) manifests")
    alias_of: dict[str, str] = {}
    table = _collect_sources(sources, problems, alias_of)
    dests = _resolve_aliases(dests, alias_of)
    used = _validate_dests(dests, table, problems, config)
    if not config.allow_unused_sources:
        for name in sorted(set(table) - used):
            problems.append(f"trainer tensor {name!r} is read by no engine recipe (extra tensor)")
    if problems:
        raise PlanMismatchError(problems)
    return table, dests


def _resolve_aliases(
    dests: Sequence[DestManifest], alias_of: dict[str, str]
) -> Sequence[DestManifest]:
    """Engine manifests whose recipes read tied parameters by the name their tensor is listed
    by. Replicas share their recipe tuples, so each distinct tuple is resolved once."""
    if not alias_of:
        return dests
    memo: dict[int, tuple[Recipe, ...]] = {}
    out = []
    for d in dests:
        recipes = memo.get(id(d.recipes))
        if recipes is None:
            resolved = tuple(_resolve_recipe(rc, alias_of) for rc in d.recipes)
            changed = any(a is not b for a, b in zip(resolved, d.recipes, strict=True))
            recipes = memo[id(d.recipes)] = resolved if changed else d.recipes
        out.append(d if recipes is d.recipes else dataclasses.replace(d, recipes=recipes))
    return out


def _resolve_recipe(rc: Recipe, alias_of: dict[str, str]) -> Recipe:
    if not any(p.source in alias_of for p in rc.parts) and not any(
        s.name in alias_of for s in rc.sources
    ):
        return rc
    return dataclasses.replace(
        rc,
        parts=tuple(
            dataclasses.replace(p, source=alias_of.get(p.source, p.source)) for p in rc.parts
        ),
        sources=tuple(
            dataclasses.replace(s, name=alias_of.get(s.name, s.name)) for s in rc.sources
        ),
    )


class _Planning:
    """The state one plan builds up, step by step (`_plan` calls the steps in order)."""

    def __init__(
        self, world: int, engines: list[str], table: dict[str, _Source], config: PlannerConfig
    ) -> None:
        self.world, self.engines, self.table, self.config = world, engines, table, config
        self.problems: list[str] = []
        # Direct work in generation order (engines sorted, recipes in manifest order): the
        # stable tie-break of every later sort, so equal inputs give equal schedules.
        self.directs: list[tuple[_Piece, str, str, str]] = []  # (piece, engine, dest, dtype)
        self.gather_units: dict[_GatherKey, list[_Unit]] = defaultdict(list)
        self.gather_seq: dict[_GatherKey, int] = {}
        # Units one rank can quantize from its own shards, with the ranks that can: (unit, seq).
        self.local_units: list[tuple[_Unit, tuple[int, ...], tuple[str, ...], int]] = []
        self.pending: dict[tuple[str, ...], list[_Unit]] = defaultdict(list)
        self.pending_seq: dict[tuple[str, ...], int] = {}
        self.cands_of: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
        self.load = [0] * world  # bytes each rank sends so far
        self.assigned: list[int] = []  # rank of each direct piece
        self.gather_local: set[_GatherKey] = set()
        self.gathers: dict[_GatherKey, _Gather] = {}  # those that need a collective
        self.local_gathers: dict[_GatherKey, _LocalGather] = {}
        # (seq, mesh, sources) of every one-rank gather, the order their units are batched in
        # (unique: the rest of each entry is never compared), then for a gather of one unit of
        # one layout that layout and unit (`build_gathers`), else None and None.
        self.local_order: list[
            tuple[int, tuple[int, ...], tuple[str, ...], _Layout | None, _SingleEntry | None]
        ] = []
        self.single_layouts: dict[_GatherKey, list[_Layout]] = defaultdict(list)
        self.groups: list[list[tuple[int, ...]]] = []
        self.mesh_group: dict[tuple[int, ...], int] = {}
        self.per_rank: list[list[Task]] = [[] for _ in range(world)]
        self.rank_bytes = [0] * world
        self.peers_of: list[set[str]] = [set() for _ in range(world)]  # engines each rank writes
        self.bytes_per_engine = dict.fromkeys(engines, 0)
        self.next_id = 0

    def _check(self) -> None:
        if self.problems:
            raise PlanMismatchError(self.problems)

    def compile_engines(self, dests: Sequence[DestManifest]) -> None:
        """Every engine's recipes as write templates, sorted into direct pieces, gather units,
        local quant units and quant units waiting for a mesh.

        Replicas share their recipe and tensor tuples (one layout), and engine ranks holding the
        same slice at the same place have equal recipes: a layout is compiled once into write
        templates (recipe geometry found by identity first, by value second), and each engine
        only stamps its name on them.
        """
        direct_by_id: dict[tuple[object, ...], _DirectTemplate] = {}
        direct_by_value: dict[tuple[object, ...], _DirectTemplate] = {}
        quant_by_id: dict[tuple[object, ...], _QuantUnits] = {}
        quant_by_value: dict[tuple[object, ...], _QuantUnits] = {}
        layouts: dict[tuple[int, int], _Layout] = {}
        shard_memo = _ShardMemo()
        gather_seq, gather_local = self.gather_seq, self.gather_local
        load = self.load
        table, problems = self.table, self.problems
        for d in sorted(dests, key=lambda d: d.engine):
            engine = d.engine
            lay = layouts.get((id(d.tensors), id(d.recipes)))
            if lay is None:
                lay = layouts[(id(d.tensors), id(d.recipes))] = _compile_layout(
                    d,
                    table,
                    self.config,
                    problems,
                    direct_by_id,
                    direct_by_value,
                    quant_by_id,
                    quant_by_value,
                    self.cands_of,
                    shard_memo,
                )
                for key, sq in lay.gather_seq.items():
                    self.gather_seq[key] = min(sq, self.gather_seq.get(key, sq))
                for names, sq in lay.pending_seq.items():
                    self.pending_seq[names] = min(sq, self.pending_seq.get(names, sq))
                # Units one rank alone holds (a band of an FSDP shard) go to it whatever the
                # balance: filed and counted as each engine is, before any choice is made.
                for key, sq in lay.single_seq.items():
                    gather_local.add(key)
                    gather_seq[key] = min(sq, gather_seq.get(key, sq))
                    self.single_layouts[key].append(lay)
            # Every write made below lands in the schedule (or the plan fails).
            self.bytes_per_engine[engine] = lay.nbytes
            self.directs.extend([(pc, engine, dest, dtype) for pc, dest, dtype in lay.directs])
            for key, p, runs, nbytes, dest, dtype in lay.copies:
                self.gather_units[key].append(
                    (
                        SliceWrite(
                            engine, dest, p.source, p.source_box, p.dest_box, dtype, runs, False
                        ),
                        nbytes,
                        numel(box_shape(p.dest_box)),
                    )
                )
            for r, nb in lay.single_load.items():
                load[r] += nb
            # Their writes are stamped with the engine names when their tasks are built.
            lay.engines.append(engine)
            for u, dest, sdest, block, sq, quant_names in lay.quants:
                qw = _quant_write(
                    engine,
                    dest,
                    sdest,
                    block,
                    u.parts,
                    u.dest_box,
                    u.scale_box,
                    u.weight_runs,
                    u.scale_runs,
                )
                if u.local:
                    self.local_units.append(((qw, u.nbytes, u.numel), u.local, u.sources, sq))
                elif quant_names is not None:
                    self.pending[quant_names].append((qw, u.nbytes, u.numel))
                else:
                    meshes = {_gather_mesh(table[n], problems) for n in u.sources}
                    problems.append(
                        f"engine {engine!r}: {dest!r} needs sources on different meshes "
                        f"({sorted(str(m) for m in meshes)}); cannot gather them together"
                    )
        self._check()

    def balance_local_work(self) -> None:
        """Give every direct piece and local quant unit to the least-loaded rank holding it.

        Each trainer GPU sends through its own NICs, so bytes per rank are bytes per NIC. The
        most constrained work goes first (only its holders can send it), largest first; gathers,
        whose units can go to any rank of their mesh, come later.
        """
        load, directs, local_units = self.load, self.directs, self.local_units
        self.assigned = [0] * len(directs)
        # (bytes, kind, index): kind 0 a direct piece, 1 a local unit; reverse=True keeps equal
        # sizes in generation order (Python's sort is stable both ways).
        work = [(it[0].nbytes, 0, i) for i, it in enumerate(directs)]
        # Units one rank alone holds went to it in `compile_engines`.
        work.extend((lu[0][1], 1, i) for i, lu in enumerate(local_units))
        work.sort(key=operator.itemgetter(0), reverse=True)
        assigned, load_of = self.assigned, load.__getitem__
        gather_local, gather_units, gather_seq = (
            self.gather_local,
            self.gather_units,
            self.gather_seq,
        )
        for nbytes, kind, i in work:
            if kind == 0:
                cands = directs[i][0].candidates  # sorted: min keeps the lowest of equals
                r = cands[0] if len(cands) == 1 else min(cands, key=load_of)
                assigned[i] = r
            else:
                unit, cands, names, sq = local_units[i]
                r = cands[0] if len(cands) == 1 else min(cands, key=load_of)
                key = ((r,), names)
                gather_local.add(key)
                gather_units[key].append(unit)
                gather_seq[key] = min(sq, gather_seq.get(key, sq))
            load[r] += nbytes

    def place_replicated_gathers(self) -> None:
        """Pick a mesh for each quant source set that several disjoint meshes hold (HSDP).

        The least-loaded mesh per source set (by bytes per rank, counting the work so far),
        largest sets first, so replicas share the work.
        """
        load, pending = self.load, self.pending
        mesh_load: dict[tuple[int, ...], int] = {}
        for key, units_k in self.gather_units.items():
            if key not in self.gather_local:
                mesh_load[key[0]] = mesh_load.get(key[0], 0) + sum(u[1] for u in units_k)
        totals = {n: sum(u[1] for u in us) for n, us in pending.items()}
        for names in sorted(pending, key=lambda n: (-totals[n], n)):
            mesh_cands = self.cands_of[names]
            for m in mesh_cands:
                if m not in mesh_load:
                    mesh_load[m] = 0
            mesh = mesh_cands[0]
            if len(mesh_cands) > 1:
                mesh = min(
                    mesh_cands,
                    key=lambda m: ((mesh_load[m] + sum(load[r] for r in m)) / len(m), m),
                )
            mesh_load[mesh] += totals[names]
            key = (mesh, names)
            self.gather_units[key].extend(pending[names])
            sq = self.pending_seq[names]
            self.gather_seq[key] = min(sq, self.gather_seq.get(key, sq))

    def build_gathers(self) -> None:
        """One gather per (mesh, source set): its units spread over the mesh's ranks by load,
        and its temporary memory checked against the budget. Units a rank quantizes from its
        own shards (a one-rank key) need no collective: a light `_LocalGather` each."""
        table, load = self.table, self.load
        budget = self.config.memory_budget_bytes
        over: list[tuple[_GatherKey, int]] = []  # reported in key order, as gathers are built
        gather_local, gather_seq = self.gather_local, self.gather_seq
        collective = [k for k in self.gather_units if k not in gather_local]
        # Local ones first, in any order (10^5 of them; they are sorted when batched).
        single_layouts = self.single_layouts
        no_units: list[_Unit] = []
        order = self.local_order
        general = dict.fromkeys(k for k in self.gather_units if k in gather_local)
        for key, lays in single_layouts.items():
            # One unit of one layout, written to that layout's engines (each band of Kimi-K2's
            # experts): nothing to record beyond its place in the order.
            if key not in general and len(lays) == 1:
                entries = lays[0].singles[key]
                if len(entries) == 1:
                    _, nb, nel = entries[0]
                    if nb + nel * 4 > budget:
                        over.append((key, nb + nel * 4))
                    order.append((gather_seq[key], key[0], key[1], lays[0], entries[0]))
                    continue
            general[key] = None
        for key in general:
            order.append((gather_seq[key], key[0], key[1], None, None))
            units_k = self.gather_units.get(key, no_units)
            lays = single_layouts.get(key, [])
            nel = max([u[2] for u in units_k], default=0)
            wire = sum([u[1] for u in units_k])
            for lay in lays:
                entries = lay.singles[key]
                nel = max(nel, *[e[2] for e in entries])
                wire += len(lay.engines) * sum([e[1] for e in entries])
            scratch = nel * 4  # assembly in float32
            if not units_k and len(lays) == 1 and len(lays[0].singles[key]) == 1:
                staging = lays[0].singles[key][0][1]  # one unit, written to each engine replica
            else:
                staging = _distinct_staging(
                    [
                        (_quant_write("", *e[0]), e[1], e[2])
                        for lay in lays
                        for e in lay.singles[key]
                    ]
                    + units_k
                )
            self.local_gathers[key] = _LocalGather(
                key[0][0],
                key[0],
                key[1],
                scratch,
                [u[0] for u in units_k],
                staging,
                wire,
                gather_seq[key],
                lays,
            )
            if scratch + staging > budget:
                over.append((key, scratch + staging))
        # Their unit lists are not needed any more: free them before the tasks are built.
        self.gather_units = defaultdict(list, {k: self.gather_units[k] for k in collective})
        for key in sorted(collective):
            mesh, names = key
            units_k = self.gather_units[key]
            scratch = max([u[2] for u in units_k]) * 4  # assembly in float32
            scratch += sum(numel(table[n].shape) * dtype_size(table[n].dtype) for n in names)
            ranks_sorted = sorted(mesh)
            by_rank: dict[int, list[SliceWrite | QuantWrite]] = {r: [] for r in ranks_sorted}
            rank_staging = dict.fromkeys(ranks_sorted, 0)
            rank_wire = dict.fromkeys(ranks_sorted, 0)
            # The executor stages each distinct unit of a task once: engine replicas' copies of
            # one unit (equal `staging_key`) on one rank count once in its staging.
            units_k.sort(key=lambda u: -u[1])  # stable: generation order among equal sizes
            staged: set[tuple[int, tuple[object, ...] | None]] = set()
            for w, nb, _ in units_k:
                # min over the sorted mesh returns the lowest rank among equally loaded ones.
                r = min(ranks_sorted, key=load.__getitem__)
                load[r] += nb
                by_rank[r].append(w)
                rank_wire[r] += nb
                skey = (r, staging_key(w))
                if skey not in staged:
                    staged.add(skey)
                    rank_staging[r] += nb
            g = self.gathers[key] = _Gather(
                mesh, names, scratch, by_rank, rank_staging, rank_wire, False, self.gather_seq[key]
            )
            need = g.scratch_bytes + max(g.staging.values(), default=0)
            if need > budget:
                over.append((key, need))
        for key, need in sorted(over):
            self.problems.append(
                f"gathering {list(key[1])} needs {need} bytes of temporary memory, more "
                f"than memory_budget_bytes={budget}"
            )
        self._check()

    def colour_mesh_groups(self) -> None:
        """Mesh groups: greedy colouring of meshes so that meshes of one group share no rank."""
        mesh_list = sorted({g.mesh for g in self.gathers.values()}, key=lambda m: (-len(m), m))
        group_ranks: list[set[int]] = []
        for m in mesh_list:
            ms = set(m)
            for gi, members in enumerate(self.groups):
                if not ms & group_ranks[gi]:
                    members.append(m)
                    group_ranks[gi] |= ms
                    self.mesh_group[m] = gi
                    break
            else:
                self.mesh_group[m] = len(self.groups)
                self.groups.append([m])
                group_ranks.append(ms)

    def gather_tasks(self) -> None:
        """Gather tasks: every rank of a mesh sees its mesh's gathers in the same order.

        Each mesh walks the model in the engines' recipe order, starting at its own offset (its
        index in its group), so that at any moment the meshes of a group work on different
        layers and every engine is fed by several meshes at once rather than all meshes feeding
        the same engines' same tensors together.
        """
        by_mesh: dict[tuple[int, ...], list[_Gather]] = defaultdict(list)
        for g in self.gathers.values():
            by_mesh[g.mesh].append(g)
        ordered: list[tuple[int, int, int, _Gather]] = []
        for gi, members in enumerate(self.groups):
            for mi, m in enumerate(sorted(members)):
                gs = sorted(by_mesh[m], key=lambda g: (g.seq, g.sources))
                shift = (mi * len(gs)) // len(members)
                for pos, g in enumerate(gs[shift:] + gs[:shift]):
                    ordered.append((gi, pos, mi, g))
        ordered.sort(key=lambda x: (x[0], x[1], x[2]))
        for g in [x[3] for x in ordered]:
            group = self.mesh_group.get(g.mesh, 0)
            for rank in g.mesh:
                mine = g.by_rank[rank]
                nbytes = g.staging[rank]
                self.rank_bytes[rank] += g.wire[rank]
                self.per_rank[rank].append(
                    Task(
                        self.next_id,
                        "gather",
                        group,
                        g.mesh,
                        g.sources,
                        tuple(mine),
                        nbytes,
                        g.scratch_bytes,
                        0,
                    )
                )
            self.next_id += 1
        self._local_quant_tasks()

    def _local_quant_tasks(self) -> None:
        """Local quantization units as tasks of about `task_target_bytes` each.

        A rank's units that need no collective (whole units in its shards, and the bands of
        units its shards split) are batched in recipe order, as small direct writes are: one
        band of one expert is a few MB, and a task per source set cost Kimi-K2's ranks 2,300
        tasks each. Merging never crosses a mesh group, and a batch closes before its staging
        (each unit once, however many engine replicas it is written to) would exceed the target
        or half the memory budget (its staging is held at once)."""
        limit = min(self.config.task_target_bytes, self.config.memory_budget_bytes // 2)
        batches: dict[int, _LocalBatch] = {}

        engine_of = operator.attrgetter("engine")

        def close(rank: int) -> None:
            b = batches.pop(rank)
            self.rank_bytes[rank] += b.wire
            self.peers_of[rank].update(map(engine_of, b.writes))
            self.per_rank[rank].append(
                Task(
                    self.next_id,
                    "direct",
                    b.group,
                    (rank,),
                    tuple(dict.fromkeys(b.names)),
                    tuple(b.writes),
                    b.staging,
                    b.scratch,
                    0,
                )
            )
            self.next_id += 1

        local_gathers = self.local_gathers
        # Local gathers' meshes are one rank: their group is that one-rank mesh's, if any.
        group_of = [self.mesh_group.get((r,), 0) for r in range(self.world)]
        new, (s0, s1, s2, s3, s4, s5, s6, s7, s8) = _new, _QW
        self.local_order.sort()
        for _, mesh, names, lay, entry in self.local_order:
            made: list[SliceWrite | QuantWrite] | None = None
            if lay is not None and entry is not None:  # one unit of one layout
                args, nbytes, nel = entry
                wire, scratch = nbytes * len(lay.engines), nel * 4
            else:
                g = local_gathers[(mesh, names)]
                made = g.all_writes()
                if not made:
                    continue
                nbytes, wire, scratch = g.staging, g.wire, g.scratch_bytes
            rank = mesh[0]
            group = group_of[rank]
            b = batches.get(rank)
            if b is not None and (b.group != group or b.staging + nbytes > limit):
                close(rank)
                b = None
            if b is None:
                b = batches[rank] = _LocalBatch(group, list(names), [], nbytes, wire, scratch)
            else:
                b.names.extend(names)
                b.staging += nbytes
                b.wire += wire
                if scratch > b.scratch:
                    b.scratch = scratch
            if made is not None:
                b.writes.extend(made)
                continue
            # Each engine of the layout gets the unit's write (`_quant_write`, inlined: this
            # loop makes 2.4 M writes for Kimi-K2).
            assert lay is not None
            a0, a1, a2, a3, a4, a5, a6, a7 = args
            append = b.writes.append
            for e in lay.engines:
                w = new(QuantWrite)
                s0(w, e)
                s1(w, a0)
                s2(w, a1)
                s3(w, a2)
                s4(w, a3)
                s5(w, a4)
                s6(w, a5)
                s7(w, a6)
                s8(w, a7)
                append(w)
        for rank in sorted(batches):
            close(rank)

    def direct_tasks(self) -> None:
        """Direct writes: per rank, interleave engines (each rank starting at its own engine),
        batch small writes into tasks; zero-copy where the rank's shard holds the bytes
        contiguously in the engine's dtype."""
        world, engines, table, config = self.world, self.engines, self.table, self.config
        queues: list[dict[str, list[int]]] = [defaultdict(list) for _ in range(world)]
        for i, r in enumerate(self.assigned):
            queues[r][self.directs[i][1]].append(i)
        zero_memo: dict[int, bool] = {}  # id(piece) * world + rank -> zero-copy
        # id(piece) -> a number naming what it stages (source, box, dtype): pieces of equal
        # geometry from different templates stage the same bytes.
        sid_of: dict[int, int] = {}
        sid_by_value: dict[tuple[str, Box, str], int] = {}
        rank_bytes = self.rank_bytes
        target = config.task_target_bytes
        half_budget = config.memory_budget_bytes // 2
        for rank in range(world):
            q = queues[rank]
            order: list[int] = []
            rot = engines[rank % len(engines) :] + engines[: rank % len(engines)]
            active = [q[e] for e in rot if e in q]
            depth = 0
            while active:
                order.extend(lst[depth] for lst in active)
                depth += 1
                active = [lst for lst in active if len(lst) > depth]
            batch: list[SliceWrite] = []
            staging = h2d = batch_bytes = 0
            staged: set[int] = set()
            sent = 0
            for i in order:
                pc, engine, dest, dtype = self.directs[i]
                zkey = id(pc) * world + rank
                zero = zero_memo.get(zkey)
                if zero is None:
                    zero = False
                    lb = pc.boxes.get(rank)
                    if lb is not None and len(pc.runs) == 1 and table[pc.source].dtype == dtype:
                        local_box = tuple(
                            (a - o, b - o) for (a, b), (o, _) in zip(pc.source_box, lb, strict=True)
                        )
                        zero = is_contiguous_box(box_shape(lb), local_box)
                    zero_memo[zkey] = zero
                # Another engine replica's copy of a piece this batch stages already costs no
                # staging: the executor stages each distinct piece of a task once.
                skey = sid_of.get(id(pc))
                if skey is None:
                    skey = sid_of[id(pc)] = sid_by_value.setdefault(
                        (pc.source, pc.source_box, dtype), len(sid_by_value)
                    )
                nb = pc.nbytes
                cost = 0 if zero or skey in staged else nb
                if batch and (batch_bytes + nb > target or staging + cost > half_budget):
                    self._direct_task(rank, batch, staging, h2d)
                    batch, staging, h2d, batch_bytes = [], 0, 0, 0
                    staged.clear()
                    cost = 0 if zero else nb
                if not zero:
                    staged.add(skey)
                batch.append(
                    _slice_write(
                        engine, dest, pc.source, pc.source_box, pc.dest_box, dtype, pc.runs, zero
                    )
                )
                staging += cost
                batch_bytes += nb
                sent += nb
                if pc.any_offloaded and pc.offloaded.get(rank, False):
                    h2d += numel(box_shape(pc.source_box)) * pc.src_itemsize
            if batch:
                self._direct_task(rank, batch, staging, h2d)
            rank_bytes[rank] += sent

    def _direct_task(self, rank: int, batch: list[SliceWrite], staging: int, h2d: int) -> None:
        self.per_rank[rank].append(
            Task(self.next_id, "direct", 0, (rank,), (), tuple(batch), staging, 0, h2d)
        )
        self.next_id += 1

    def interleave(self) -> None:
        """Spread direct tasks between gather tasks so writes overlap the collectives."""
        for rank in range(self.world):
            tasks = self.per_rank[rank]
            gath = [t for t in tasks if t.kind == "gather"]
            direct = [t for t in tasks if t.kind == "direct"]
            merged: list[Task] = []
            if gath:
                step = max(1, -(-len(direct) // (len(gath) + 1)))
                di = 0
                for t in gath:
                    merged.extend(direct[di : di + step])
                    di += step
                    merged.append(t)
                merged.extend(direct[di:])
                # Keep groups in order: a barrier separates them, so stable-sort by group.
                merged.sort(key=lambda t: t.mesh_group)
            else:
                merged = direct
            self.per_rank[rank] = merged

    def schedule(self, fingerprint: str) -> Schedule:
        """The frozen schedule, with each engine's version word given to the rank that sends
        least among those writing to it."""
        world, engines = self.world, self.engines
        senders_of: dict[str, set[int]] = defaultdict(set)
        bytes_per_engine = self.bytes_per_engine
        peers_of = self.peers_of  # local quant tasks filed theirs
        engine_of = operator.attrgetter("engine")
        for g in self.gathers.values():
            for rank, ws in g.by_rank.items():
                peers_of[rank].update(map(engine_of, ws))
        for i, r in enumerate(self.assigned):
            peers_of[r].add(self.directs[i][1])
        for rank in range(world):
            for e in peers_of[rank]:
                senders_of[e].add(rank)
        version_engines: dict[int, list[str]] = defaultdict(list)
        vload = list(self.load)
        for e in engines:
            writer_cands = sorted(senders_of.get(e, set())) or list(range(world))
            r = min(writer_cands, key=lambda r: (vload[r], r))
            vload[r] += 1
            version_engines[r].append(e)
        num_groups = max(1, len(self.groups))
        ranks_out = [
            RankSchedule(
                rank=rank,
                tasks=tuple(self.per_rank[rank]),
                peers=tuple(sorted(peers_of[rank] | set(version_engines[rank]))),
                version_engines=tuple(version_engines[rank]),
                memory_budget_bytes=self.config.memory_budget_bytes,
                num_mesh_groups=num_groups,
            )
            for rank in range(world)
        ]
        return Schedule(
            format_version=FORMAT_VERSION,
            fingerprint=fingerprint,
            num_ranks=world,
            engines=tuple(engines),
            num_mesh_groups=num_groups,
            ranks=tuple(ranks_out),
            bytes_per_rank=tuple(self.rank_bytes),
            bytes_per_engine=tuple(bytes_per_engine[e] for e in engines),
        )


def _gather_mesh(src: _Source, problems: list[str]) -> tuple[int, ...] | None:
    meshes = sorted({h[MESH] for h in src.holders}, key=lambda m: (-len(m), m))
    if not meshes:
        problems.append(f"tensor {src.name!r}: no trainer rank holds it")
        return None
    return meshes[0]


@dataclasses.dataclass(slots=True)
class _ShardMemo:
    """Geometry of FP8 units that depends only on boxes and on how their sources are sharded
    (`_Source.sig`), computed once per distinct case instead of once per expert and layer."""

    sigs: dict[tuple[object, ...], int] = dataclasses.field(default_factory=dict)
    local: dict[tuple[object, ...], tuple[int, ...]] = dataclasses.field(default_factory=dict)
    bands: dict[tuple[object, ...], list[_BandTemplate] | None] = dataclasses.field(
        default_factory=dict
    )
    names: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    units: dict[tuple[object, ...], list[_UnitTemplate]] = dataclasses.field(default_factory=dict)

    def local_holder(self, parts: Sequence[Part], table: dict[str, _Source]) -> tuple[int, ...]:
        sigs = self.sigs
        key = tuple((p.source_box, table[p.source].sig(sigs)) for p in parts)
        got = self.local.get(key)
        if got is None:
            got = self.local[key] = _local_holder(parts, table)
        return got

    def row_bands(
        self, parts: Sequence[Part], ubox: Box, block: tuple[int, int], table: dict[str, _Source]
    ) -> list[tuple[Box, tuple[Part, ...], tuple[int, ...]]] | None:
        sigs = self.sigs
        key = (
            ubox,
            block,
            tuple((p.source_box, p.dest_box, table[p.source].sig(sigs)) for p in parts),
        )
        if key in self.bands:
            tmpl = self.bands[key]
        else:
            tmpl = self.bands[key] = _row_bands(parts, ubox, block, table)
        if tmpl is None:
            return None
        return [
            (
                bbox,
                tuple(
                    parts[i] if sb is None else _part(parts[i].source, sb, db)
                    for i, sb, db in bparts
                ),
                holders,
            )
            for bbox, bparts, holders in tmpl
        ]


_BandTemplate = tuple[Box, tuple[tuple[int, Box | None, Box], ...], tuple[int, ...]]
"""A band of `_row_bands`: its box, its parts as (index of the unit's part, clipped source box
or None for the whole part, clipped destination box), and the ranks holding it."""


_QuantUnits = tuple[list[tuple["_GatherKey", "_SingleEntry"]], list["_QuantUnit"]]
"""A recipe's units: those one rank alone can quantize, as (task key, entry), then the rest."""

_UnitTemplate = tuple["_QuantUnit", tuple[tuple[int, Box, Box], ...], tuple[int, ...]]
"""A quant unit computed with placeholder sources and tensors at offset 0 of region 0, its
parts as (index of the recipe's part, source box, destination box), and the indices of its
sources."""


def _quant_units_like(
    rc: Recipe,
    dt: DestTensor,
    st: DestTensor,
    table: dict[str, _Source],
    *,
    bands: bool,
    memo: _ShardMemo,
) -> _QuantUnits:
    """`_quant_units`, computed once per geometry: recipes whose parts have equal boxes and
    whose sources are sharded alike (`_Source.sig`: the same expert in every layer) into
    tensors of equal shapes share one template, instantiated with their sources and places.

    Units that only one rank can quantize come first as (task key, `_SingleEntry`): they are
    never balanced, so they skip the `_QuantUnit` (Kimi-K2: 553k expert bands)."""
    assert rc.quant is not None
    srcs = [p.source for p in rc.parts]
    sigs = memo.sigs
    key = (
        tuple((p.source_box, p.dest_box, table[p.source].sig(sigs)) for p in rc.parts),
        dt.shape,
        st.shape,
        rc.quant.block,
        bands,
    )
    tmpl = memo.units.get(key)
    if tmpl is None:
        anon = [f"#{i}" for i in range(len(srcs))]
        units = _quant_units(
            Recipe(
                rc.dest,
                tuple(
                    Part(a, p.source_box, p.dest_box) for a, p in zip(anon, rc.parts, strict=True)
                ),
                rc.quant,
            ),
            DestTensor(dt.name, dt.shape, dt.dtype, 0, 0),
            DestTensor(st.name, st.shape, st.dtype, 0, 0),
            {a: table[n] for a, n in zip(anon, srcs, strict=True)},
            bands=bands,
            memo=memo,
        )
        tmpl = memo.units[key] = [
            (
                u,
                tuple((int(p.source[1:]), p.source_box, p.dest_box) for p in u.parts),
                tuple(sorted({int(n[1:]) for n in u.sources})),
            )
            for u in units
        ]
    names_of = memo.names
    wreg, woff, sreg, soff = dt.region, dt.offset_bytes, st.region, st.offset_bytes
    dest, sdest, block = rc.dest, st.name, rc.quant.block
    singles: list[tuple[_GatherKey, _SingleEntry]] = []
    out: list[_QuantUnit] = []
    for u, ptmpl, idxs in tmpl:
        if len(idxs) == 1:
            src = srcs[idxs[0]]
            names = names_of.get(src)
            if names is None:
                names = names_of[src] = (src,)
        else:
            names = tuple(sorted({srcs[i] for i in idxs}))
        wr, sr = u.weight_runs, u.scale_runs
        parts = tuple([_part(srcs[i], sb, db) for i, sb, db in ptmpl])
        wruns = (
            (_write_run(wreg, wr[0].offset_bytes + woff, wr[0].nbytes),)
            if len(wr) == 1
            else tuple([_write_run(wreg, r.offset_bytes + woff, r.nbytes) for r in wr])
        )
        sruns = (
            (_write_run(sreg, sr[0].offset_bytes + soff, sr[0].nbytes),)
            if len(sr) == 1
            else tuple([_write_run(sreg, r.offset_bytes + soff, r.nbytes) for r in sr])
        )
        if len(u.local) == 1:
            singles.append(
                (
                    (u.local, names),
                    (
                        (dest, sdest, block, parts, u.dest_box, u.scale_box, wruns, sruns),
                        u.nbytes,
                        u.numel,
                    ),
                )
            )
            continue
        out.append(
            _QuantUnit(
                u.dest_box, u.scale_box, parts, names, wruns, sruns, u.local, u.nbytes, u.numel
            )
        )
    return singles, out


def _quant_units(
    rc: Recipe,
    dt: DestTensor,
    st: DestTensor,
    table: dict[str, _Source],
    *,
    bands: bool,
    memo: _ShardMemo,
) -> list[_QuantUnit]:
    """Quantization units of an FP8 recipe (one per leading index, e.g. per expert; with
    `bands`, a unit spanning trainer shards on block rows becomes one unit per shard band)."""
    assert rc.quant is not None
    lead = dt.shape[:-2]
    nlead = len(lead)
    # Parts by the leading index they touch, so each unit clips only its own parts.
    parts_at: dict[tuple[int, ...], list[Part]] = defaultdict(list)
    if lead:
        for p in rc.parts:
            for idx in itertools.product(*(range(a, b) for a, b in p.dest_box[:nlead])):
                parts_at[idx].append(p)
    unit_w = numel(dt.shape[nlead:])
    unit_s = numel(st.shape[nlead:]) * 4
    out: list[_QuantUnit] = []
    wruns: tuple[WriteRun, ...]
    sruns: tuple[WriteRun, ...]
    for idx in itertools.product(*(range(n) for n in lead)) if lead else [()]:
        prefix = tuple((i, i + 1) for i in idx)
        ubox = prefix + tuple((0, n) for n in dt.shape[nlead:])
        sbox = prefix + tuple((0, n) for n in st.shape[nlead:])
        candidates = parts_at.get(idx, []) if lead else rc.parts
        parts = tuple(
            c
            for c in (
                p if p.dest_box[:nlead] == prefix else _clip_part_to_dest(p, ubox)
                for p in candidates
            )
            if c is not None
        )
        local = memo.local_holder(parts, table)
        cut = memo.row_bands(parts, ubox, rc.quant.block, table) if bands and not local else None
        # The leading slice's row-major index (0 without leading dims).
        flat = 0
        for i, n in zip(idx, lead, strict=True):
            flat = flat * n + i
        if cut is not None:
            # A band is whole rows of one leading slice: one contiguous run of weights, one
            # of scales.
            rows, cols = dt.shape[-2:]
            srows, scols = st.shape[-2:]
            b0 = rc.quant.block[0]
            wbase = dt.offset_bytes + flat * rows * cols
            sbase = st.offset_bytes + flat * srows * scols * 4
            names_of = memo.names
            for bbox, bparts, holders in cut:
                r0, r1 = bbox[-2]
                s0, s1 = r0 // b0, -(-r1 // b0)
                bsbox = (*sbox[:-2], (s0, s1), sbox[-1])
                wlen, slen = (r1 - r0) * cols, (s1 - s0) * scols * 4
                if len(bparts) == 1:
                    src = bparts[0].source
                    names = names_of.get(src)
                    if names is None:
                        names = names_of[src] = (src,)
                else:
                    names = tuple(sorted({p.source for p in bparts}))
                out.append(
                    _QuantUnit(
                        bbox,
                        bsbox,
                        bparts,
                        names,
                        (_write_run(dt.region, wbase + r0 * cols, wlen),),
                        (_write_run(st.region, sbase + s0 * scols * 4, slen),),
                        holders,
                        wlen + slen,
                        wlen,  # elements: whole rows of one leading slice
                    )
                )
            continue
        if lead:
            # A unit is one whole leading slice: one run at its flat index.
            wruns = (WriteRun(dt.region, dt.offset_bytes + flat * unit_w, unit_w),)
            sruns = (WriteRun(st.region, st.offset_bytes + flat * unit_s, unit_s),)
        else:
            wruns = dest_runs(dt.shape, ubox, 1, dt.offset_bytes, dt.region)
            sruns = dest_runs(st.shape, sbox, 4, st.offset_bytes, st.region)
        out.append(
            _QuantUnit(
                ubox,
                sbox,
                parts,
                tuple(sorted({p.source for p in parts})),
                wruns,
                sruns,
                local,
                sum(r.nbytes for r in wruns) + sum(r.nbytes for r in sruns),
                numel(box_shape(ubox)),
            )
        )
    return out


def _row_bands(
    parts: Sequence[Part], ubox: Box, block: tuple[int, int], table: dict[str, _Source]
) -> list[_BandTemplate] | None:
    """Cut a quant unit into bands of whole block rows that each lie in one rank's own shards.

    A unit (one expert's fused gate_up, a tensor-parallel slice) usually spans several trainer
    shards, and quantizing it whole needs `full_tensor()` on the sources' mesh. The unit is cut
    at every part's edge and every shard edge mapped into destination rows; adjacent pieces
    held by a common rank merge into a band. When every band starts on a block row (FSDP's
    dim-0 chunks of 128-row multiples: 256 rows of an expert over 8 ranks), each band holds
    whole 128x128 blocks of one rank's shards, so that rank quantizes it alone and nothing is
    gathered; its scales are the numbers the gathered unit would give. None when a piece spans
    ranks or a band starts inside a block (the unit is then gathered, as before).
    """
    rd = len(ubox) - 2
    lo, hi = ubox[rd]
    cuts = {lo, hi}
    # Per part: its destination rows and, for each shard box holding the part's extent in
    # every other dimension, the destination rows that box covers and the ranks holding it.
    spans: list[tuple[int, int, list[tuple[int, int, frozenset[int]]]]] = []
    row_dim: list[int | None] = []  # the source dimension of each part's destination rows
    for p in parts:
        d0, d1 = p.dest_box[rd]
        cuts.update((d0, d1))
        if d1 - d0 == 1:
            ranks = frozenset(_local_holder([p], table))
            if not ranks:
                return None
            spans.append((d0, d1, [(d0, d1, ranks)]))
            row_dim.append(None)
            continue
        sdims = [d for d, (a, b) in enumerate(p.source_box) if b - a != 1]
        ddims = [d for d, (a, b) in enumerate(p.dest_box) if b - a != 1]
        sd = next((s for s, d in zip(sdims, ddims, strict=True) if d == rd), None)
        if sd is None:
            return None
        sb = p.source_box
        s0, s1 = sb[sd]
        covers = []
        for box, hs in table[p.source].by_box().items():
            if any(box[d][0] > sb[d][0] or sb[d][1] > box[d][1] for d in range(len(sb)) if d != sd):
                continue
            a, b = max(box[sd][0], s0), min(box[sd][1], s1)
            if a < b:
                covers.append((d0 + a - s0, d0 + b - s0, frozenset(h[RANK] for h in hs)))
                cuts.update((d0 + a - s0, d0 + b - s0))
        spans.append((d0, d1, covers))
        row_dim.append(sd)
    ordered = sorted(cuts)
    merged: list[tuple[int, int, frozenset[int]]] = []  # (first row, end row, holders)
    for a, b in itertools.pairwise(ordered):
        holders: frozenset[int] | None = None
        for d0, d1, covers in spans:
            if d1 <= a or b <= d0:
                continue
            ranks = frozenset[int]().union(*(r for c0, c1, r in covers if c0 <= a and b <= c1))
            holders = ranks if holders is None else holders & ranks
            if not holders:
                return None
        assert holders is not None  # the parts cover the unit
        if merged:
            common = merged[-1][2] & holders
            if common:
                merged[-1] = (merged[-1][0], b, common)
                continue
        merged.append((a, b, holders))
    if any(m[0] % block[0] for m in merged):
        return None  # a block would mix rows of two ranks
    bands: list[_BandTemplate] = []
    for a, b, holders in merged:
        bparts: list[tuple[int, Box | None, Box]] = []
        for i, (p, sd) in enumerate(zip(parts, row_dim, strict=True)):
            d0, d1 = p.dest_box[rd]
            if d1 <= a or b <= d0:
                continue
            if a <= d0 and d1 <= b:
                bparts.append((i, None, p.dest_box))
                continue
            assert sd is not None  # a one-row part lies inside any band it meets
            r0, r1 = max(a, d0), min(b, d1)
            s0 = p.source_box[sd][0] + r0 - d0
            src = (*p.source_box[:sd], (s0, s0 + r1 - r0), *p.source_box[sd + 1 :])
            bparts.append((i, src, (*p.dest_box[:rd], (r0, r1), *p.dest_box[rd + 1 :])))
        bbox = (*ubox[:rd], (a, b), *ubox[rd + 1 :])
        bands.append((bbox, tuple(bparts), tuple(sorted(holders))))
    return bands


def _common_gather_meshes(srcs: Sequence[_Source]) -> list[tuple[int, ...]]:
    """Meshes on which every source of `srcs` can be rebuilt with one `full_tensor()`.

    A source's gather meshes are its largest meshes; several when it is replicated over
    disjoint shard groups (HSDP). Sorted; empty when the sources share none.
    """
    common: set[tuple[int, ...]] | None = None
    for src in srcs:
        meshes = {h[MESH] for h in src.holders}
        if not meshes:
            return []
        size = max(len(m) for m in meshes)
        best = {m for m in meshes if len(m) == size}
        common = best if common is None else common & best
    return sorted(common or ())


def _local_holder(parts: Sequence[Part], table: dict[str, _Source]) -> tuple[int, ...]:
    """The ranks whose own shards contain every part's source box (no gather needed), sorted."""
    common: set[int] | None = None
    for p in parts:
        if numel(box_shape(p.source_box)) > table[p.source].max_shard_numel():
            return ()
        ranks = {
            h[RANK]
            for b, hs in table[p.source].by_box().items()
            if box_in(p.source_box, b)
            for h in hs
        }
        common = ranks if common is None else common & ranks
        if not common:
            return ()
    return tuple(sorted(common or ()))


_FINGERPRINT_TAG = "weight-transfer plan inputs v3"


def fingerprint(
    sources: Sequence[SourceManifest], dests: Sequence[DestManifest], config: PlannerConfig
) -> str:
    """sha256 of a canonical encoding of the planner's inputs.

    The bytes are msgpack of a tag, the source manifests by rank, the destination manifests by
    engine and the config, each dataclass as the array of its fields in declaration order.
    Engine replicas share their tensor and recipe tuples, whose encodings are packed once.
    """
    return _finish_fingerprint(_hash_sources(sources), dests, config, {})


def _hash_sources(sources: Sequence[SourceManifest]) -> hashlib._Hash:
    """The fingerprint's hash state after its tag and the source manifests (the costly part at
    trainer scale: 10^6 entries), which a re-plan for other engines continues from a copy of."""
    h = hashlib.sha256()
    packer = msgpack.Packer(use_bin_type=True)
    h.update(packer.pack(_FINGERPRINT_TAG))
    h.update(packer.pack_array_header(len(sources)))
    fields = operator.attrgetter(
        "name", "shape", "dtype", "local_box", "mesh", "device", "offloaded", "aliases"
    )
    for m in sorted(sources, key=lambda m: m.rank):
        h.update(packer.pack((m.rank, m.world_size, m.host, list(map(fields, m.tensors)))))
    return h


def _finish_fingerprint(
    h: hashlib._Hash,
    dests: Sequence[DestManifest],
    config: PlannerConfig,
    memo: dict[int, tuple[object, bytes]],
) -> str:
    """Hash the destination manifests and the config into `h` (after `_hash_sources`).

    `memo` maps the id of a tensor or recipe tuple to (the tuple, its packed bytes); it keeps
    the tuple alive, so an id cannot be reused while the entry exists, and a caller may pass
    the same memo to later fingerprints of manifests that share those tuples."""
    packer = msgpack.Packer(use_bin_type=True)

    def once(key: object, make: Callable[[], object]) -> bytes:
        got = memo.get(id(key))
        if got is None:
            got = memo[id(key)] = (key, packer.pack(make()))
        return got[1]

    h.update(packer.pack_array_header(len(dests)))
    for d in sorted(dests, key=lambda d: d.engine):
        h.update(packer.pack_array_header(6))
        h.update(packer.pack(d.engine))
        h.update(packer.pack(d.host))
        h.update(packer.pack([(r.index, r.nbytes, r.descriptor) for r in d.regions]))
        h.update(
            once(
                d.tensors,
                lambda d=d: [  # type: ignore[misc]
                    (t.name, t.shape, t.dtype, t.region, t.offset_bytes) for t in d.tensors
                ],
            )
        )
        h.update(
            once(
                d.recipes,
                lambda d=d: [  # type: ignore[misc]
                    (
                        rc.dest,
                        [(p.source, p.source_box, p.dest_box) for p in rc.parts],
                        None if rc.quant is None else (rc.quant.scale_dest, rc.quant.block),
                        [(x.name, x.shape, x.dtype, x.padded_dims) for x in rc.sources],
                    )
                    for rc in d.recipes
                ],
            )
        )
        h.update(packer.pack(d.version_region))
    h.update(packer.pack(codec.to_plain(config)))
    return h.hexdigest()


def schedule_to_json(schedule: Schedule) -> str:
    """Canonical JSON of a schedule."""
    return codec.to_json(schedule)


def schedule_from_json(text: str | bytes) -> Schedule:
    """Schema-checked decode of `schedule_to_json` output."""
    return codec.from_json(Schedule, text)


__all__ = [
    "PlannerConfig",
    "dest_runs",
    "fingerprint",
    "is_contiguous_box",
    "map_subbox",
    "plan",
    "schedule_from_json",
    "schedule_to_json",
]
