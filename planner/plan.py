"""The planner: source and destination manifests in, a static, balanced schedule out.

Pure and deterministic: no I/O, no clocks, no torch.distributed. The same manifests and config
give the same `Schedule`, byte for byte in its canonical JSON.

How a schedule is made:
1. Validate everything and collect every problem (missing, extra or duplicate tensors, shapes or
   dtypes no recipe explains, recipes that do not cover their destination exactly once) into
   one `PlanMismatchError`, before any byte moves.
2. Turn recipes into work. A copy recipe (no transform) becomes "direct" writes: each part is
   cut along the trainer shards it spans, and each piece is sent by a rank that holds it in its
   own shard, so no rank gathers anything and there is no rank-0 funnel. An FP8 recipe needs
   whole 128x128 blocks of the fused, sharded destination, so its sources are rebuilt with
   `full_tensor()` on their mesh ("gather" tasks); destinations that share the same sources
   share one gather, and the quantize-and-write units of a gather are spread over the mesh.
3. Balance: work is assigned largest first to the least-loaded rank that can send it.
4. Order: gather tasks of one mesh appear in the same order on every rank of that mesh; meshes
   that share no rank form a mesh group and run in parallel; groups follow each other with a
   barrier. Each task carries the temporary memory it needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence

import msgpack

from backends.base import PlanMismatchError
from planner import codec
from planner.types import (
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
    Task,
    WriteRun,
    box_in,
    box_intersection,
    box_shape,
    dtype_size,
    numel,
    squeeze_shape,
)

FORMAT_VERSION = 1
FP8_DTYPE = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """Knobs of the planner."""

    memory_budget_bytes: int = 1 << 30
    """Temporary memory per trainer rank (staging + scratch) that tasks in flight may use."""
    max_write_bytes: int = 64 << 20
    """Largest single direct write; larger pieces are split so the pipeline can overlap them."""
    task_target_bytes: int = 16 << 20
    """Small direct writes of one rank are batched into tasks of about this size."""
    allow_unused_sources: bool = False
    """If False, a trainer tensor that no recipe reads is an error (catches renames)."""

    def __post_init__(self) -> None:
        if self.memory_budget_bytes <= 0:
            raise ValueError("memory_budget_bytes must be positive")
        if self.max_write_bytes <= 0:
            raise ValueError("max_write_bytes must be positive")
        if self.task_target_bytes <= 0:
            raise ValueError("task_target_bytes must be positive")
        if self.max_write_bytes > self.memory_budget_bytes // 2:
            raise ValueError(
                "max_write_bytes must be at most half of memory_budget_bytes "
                f"({self.max_write_bytes} > {self.memory_budget_bytes // 2})"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class _Holder:
    rank: int
    local_box: Box | None
    mesh: tuple[int, ...]
    offloaded: bool


@dataclasses.dataclass(slots=True)
class _Source:
    name: str
    shape: tuple[int, ...]
    dtype: str
    holders: list[_Holder]
    # Holders grouped by local box (replicas share a box): lookups scan distinct boxes only.
    _by_box: dict[Box, tuple[_Holder, ...]] | None = None

    def by_box(self) -> dict[Box, tuple[_Holder, ...]]:
        if self._by_box is None:
            groups: dict[Box, list[_Holder]] = defaultdict(list)
            for h in self.holders:
                if h.local_box is not None:
                    groups[h.local_box].append(h)
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
        out[dd] = (part.dest_box[dd][0] + delta0, part.dest_box[dd][0] + delta0 + sub[sd][1] - sub[sd][0])
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
        src[sd] = (part.source_box[sd][0] + delta0, part.source_box[sd][0] + delta0 + inter[dd][1] - inter[dd][0])
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


def _collect_sources(sources: Sequence[SourceManifest], problems: list[str]) -> dict[str, _Source]:
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
    for m in sorted(sources, key=lambda m: m.rank):
        seen: set[str] = set()
        for t in m.tensors:
            if t.name in seen:
                problems.append(f"trainer rank {m.rank}: duplicate tensor name {t.name!r}")
                continue
            seen.add(t.name)
            try:
                dtype_size(t.dtype)
            except ValueError:
                problems.append(f"trainer rank {m.rank}: tensor {t.name!r} has unsupported dtype {t.dtype!r}")
                continue
            if t.local_box is not None and (
                len(t.local_box) != len(t.shape)
                or not box_in(t.local_box, tuple((0, n) for n in t.shape))
                or any(a > b for a, b in t.local_box)
            ):
                problems.append(
                    f"trainer rank {m.rank}: tensor {t.name!r} local shard {t.local_box} "
                    f"does not fit its global shape {t.shape}"
                )
                continue
            if m.rank not in t.mesh:
                problems.append(f"trainer rank {m.rank}: tensor {t.name!r} mesh {t.mesh} does not contain the rank")
                continue
            src = table.get(t.name)
            if src is None:
                src = table[t.name] = _Source(t.name, tuple(t.shape), t.dtype, [])
            elif src.shape != tuple(t.shape) or src.dtype != t.dtype:
                problems.append(
                    f"tensor {t.name!r}: trainer ranks disagree on shape/dtype "
                    f"({src.shape}/{src.dtype} vs rank {m.rank}: {tuple(t.shape)}/{t.dtype})"
                )
                continue
            src.holders.append(_Holder(m.rank, t.local_box, tuple(t.mesh), t.offloaded))
    covered_memo: dict[tuple[Box, ...], int] = {}
    for src in table.values():
        by_mesh: dict[tuple[int, ...], set[int]] = defaultdict(set)
        for h in src.holders:
            if len(h.mesh) > 1:
                by_mesh[h.mesh].add(h.rank)
        for mesh, have in by_mesh.items():
            if have != set(mesh):
                problems.append(
                    f"tensor {src.name!r}: mesh {mesh} is missing rank(s) {sorted(set(mesh) - have)}"
                )
        if not any(h.local_box is None for h in src.holders):
            # Tensors of one shape sharded alike share their boxes: compute coverage once.
            distinct = tuple(sorted(src.by_box()))
            covered = covered_memo.get(distinct, -1)
            if covered < 0:
                covered = covered_memo[distinct] = _union_volume(distinct)
            if covered < numel(src.shape):
                problems.append(
                    f"tensor {src.name!r}: trainer shards cover {covered} of {numel(src.shape)} elements"
                )
    return table


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


def _validate_dests(
    dests: Sequence[DestManifest], sources: dict[str, _Source], problems: list[str]
) -> set[str]:
    used: set[str] = set()
    names = [d.engine for d in dests]
    for n in sorted(set(names)):
        if names.count(n) > 1:
            problems.append(f"engine {n!r} registered more than once")
    # Replicas share their tensor and recipe tuples: an identical layout that was valid once is
    # valid again (only the engine name, which no check reads, differs).
    valid_layouts: set[tuple[object, ...]] = set()
    for d in dests:
        layout = (id(d.tensors), id(d.recipes), tuple((r.index, r.nbytes) for r in d.regions),
                  d.version_region)
        if layout in valid_layouts:
            continue
        num_problems = len(problems)
        regions = {r.index: r for r in d.regions}
        if len(regions) != len(d.regions):
            problems.append(f"engine {d.engine!r}: duplicate region indices")
        vr = regions.get(d.version_region)
        if vr is None or vr.nbytes < 8:
            problems.append(f"engine {d.engine!r}: version region {d.version_region} missing or < 8 bytes")
        tensors: dict[str, DestTensor] = {}
        for t in d.tensors:
            if t.name in tensors:
                problems.append(f"engine {d.engine!r}: duplicate tensor name {t.name!r}")
                continue
            tensors[t.name] = t
            try:
                size = numel(t.shape) * dtype_size(t.dtype)
            except ValueError:
                problems.append(f"engine {d.engine!r}: tensor {t.name!r} has unsupported dtype {t.dtype!r}")
                continue
            r = regions.get(t.region)
            if r is None or t.offset_bytes < 0 or t.offset_bytes + size > r.nbytes:
                problems.append(
                    f"engine {d.engine!r}: tensor {t.name!r} ({size} bytes at {t.offset_bytes}) "
                    f"lies outside region {t.region}"
                )
        recipes: dict[str, Recipe] = {}
        written: set[str] = set()
        for rc in d.recipes:
            if rc.dest in recipes:
                problems.append(f"engine {d.engine!r}: two recipes for {rc.dest!r}")
                continue
            recipes[rc.dest] = rc
            dt = tensors.get(rc.dest)
            if dt is None:
                problems.append(f"engine {d.engine!r}: recipe for unknown engine tensor {rc.dest!r}")
                continue
            written.add(rc.dest)
            bad = False
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
                if rc.quant is None and s.dtype != dt.dtype and not (
                    s.dtype in FLOAT_DTYPES and dt.dtype in FLOAT_DTYPES
                ):
                    problems.append(
                        f"engine {d.engine!r}: {rc.dest!r} is {dt.dtype} but {p.source!r} is "
                        f"{s.dtype}, and no recipe transform explains it"
                    )
                    bad = True
                if rc.quant is not None and s.dtype not in FLOAT_DTYPES:
                    problems.append(f"engine {d.engine!r}: cannot FP8-quantize {p.source!r} of dtype {s.dtype}")
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
                    problems.append(f"engine {d.engine!r}: FP8 tensor {rc.dest!r} must have >= 2 dims")
                elif st is None:
                    problems.append(
                        f"engine {d.engine!r}: scale tensor {rc.quant.scale_dest!r} of {rc.dest!r} is missing"
                    )
                else:
                    b0, b1 = rc.quant.block
                    *lead, rows, cols = dt.shape
                    want = (*lead, -(-rows // b0), -(-cols // b1))
                    if st.shape != want or st.dtype != "float32":
                        problems.append(
                            f"engine {d.engine!r}: scale tensor {st.name!r} is {st.shape}/{st.dtype}, "
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
        if len(problems) == num_problems:
            valid_layouts.add(layout)
    return used


# ---------------------------------------------------------------------------------------------
# Work items
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _DirectItem:
    write: SliceWrite  # zero_copy decided after assignment
    candidates: tuple[int, ...]
    nbytes: int
    boxes: dict[int, Box]  # rank -> its local box of the source (for zero-copy)
    offloaded: dict[int, bool]
    src_itemsize: int
    assigned: int = -1


@dataclasses.dataclass(slots=True)
class _Gather:
    mesh: tuple[int, ...]
    sources: tuple[str, ...]
    scratch_bytes: int
    units: list[tuple[SliceWrite | QuantWrite, int]]  # (write, assigned rank)
    local: bool  # one rank holds all needed data locally: no collective


def _pieces(part: Part, src: _Source) -> list[tuple[Box, tuple[_Holder, ...]]] | None:
    """Cut a part's source box along trainer shards; None if it needs a gather."""
    groups = src.by_box()
    containing = [h for b, hs in groups.items() if box_in(part.source_box, b) for h in hs]
    if containing:
        containing.sort(key=lambda h: h.rank)
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


def plan(
    sources: Sequence[SourceManifest],
    dests: Sequence[DestManifest],
    config: PlannerConfig | None = None,
) -> Schedule:
    """Compute the static schedule.

    Raises:
        PlanMismatchError: listing every problem found in the manifests.
    """
    config = config or PlannerConfig()
    problems: list[str] = []
    if not sources:
        problems.append("no trainer (source) manifests")
    if not dests:
        problems.append("no engine (destination) manifests")
    table = _collect_sources(sources, problems)
    used = _validate_dests(dests, table, problems)
    if not config.allow_unused_sources:
        for name in sorted(set(table) - used):
            problems.append(f"trainer tensor {name!r} is read by no engine recipe (extra tensor)")
    if problems:
        raise PlanMismatchError(problems)

    world = sources[0].world_size
    directs: list[_DirectItem] = []
    gathers: dict[tuple[tuple[int, ...], tuple[str, ...]], _Gather] = {}
    gather_units: dict[tuple[tuple[int, ...], tuple[str, ...]], list[SliceWrite | QuantWrite]] = defaultdict(list)
    gather_local_rank: dict[tuple[tuple[int, ...], tuple[str, ...]], int] = {}
    pending: dict[tuple[str, ...], list[SliceWrite | QuantWrite]] = defaultdict(list)
    pending_meshes: dict[tuple[str, ...], list[tuple[int, ...]]] = {}

    # Replicas share recipe objects: the geometry of a recipe at a given place in an engine's
    # memory is computed once and only the engine name differs between replicas.
    direct_cache: dict[tuple[object, ...], list[tuple[object, ...]] | None] = {}
    quant_cache: dict[tuple[object, ...], list[tuple[object, ...]]] = {}
    for d in sorted(dests, key=lambda d: d.engine):
        tensors = {t.name: t for t in d.tensors}
        for rc in d.recipes:
            dt = tensors[rc.dest]
            if rc.quant is None:
                out_size = dtype_size(dt.dtype)
                dkey = (id(rc), dt.shape, dt.dtype, dt.region, dt.offset_bytes)
                cached = direct_cache.get(dkey)
                if cached is not None:
                    for source, chunk, dbox, runs, nbytes, cands, boxes, offl, isz in cached:
                        directs.append(
                            _DirectItem(
                                write=SliceWrite(
                                    engine=d.engine, dest=rc.dest, source=source,  # type: ignore[arg-type]
                                    source_box=chunk, dest_box=dbox, dtype=dt.dtype,  # type: ignore[arg-type]
                                    runs=runs, zero_copy=False,  # type: ignore[arg-type]
                                ),
                                candidates=cands, nbytes=nbytes, boxes=boxes,  # type: ignore[arg-type]
                                offloaded=offl, src_itemsize=isz,  # type: ignore[arg-type]
                            )
                        )
                    continue
                template: list[tuple[object, ...]] | None = []
                for p in rc.parts:
                    src = table[p.source]
                    pieces = _pieces(p, src)
                    if pieces is None:
                        template = None
                        # Shards that are not boxes (or overlap oddly): gather, then copy.
                        key_mesh = _gather_mesh(src, problems)
                        if key_mesh is None:
                            continue
                        gather_units[(key_mesh, (p.source,))].append(
                            SliceWrite(
                                engine=d.engine, dest=rc.dest, source=p.source,
                                source_box=p.source_box, dest_box=p.dest_box, dtype=dt.dtype,
                                runs=dest_runs(dt.shape, p.dest_box, out_size, dt.offset_bytes, dt.region),
                                zero_copy=False,
                            )
                        )
                        continue
                    for piece, holders in pieces:
                        cands = tuple(sorted({h.rank for h in holders}))
                        boxes = {h.rank: h.local_box for h in holders if h.local_box}
                        offl = {h.rank: h.offloaded for h in holders}
                        isz = dtype_size(src.dtype)
                        for chunk in _split_box(piece, max(out_size, dtype_size(src.dtype)), config.max_write_bytes):
                            dbox = map_subbox(p, chunk)
                            runs = dest_runs(dt.shape, dbox, out_size, dt.offset_bytes, dt.region)
                            nbytes = sum(r.nbytes for r in runs)
                            write = SliceWrite(
                                engine=d.engine, dest=rc.dest, source=p.source, source_box=chunk,
                                dest_box=dbox, dtype=dt.dtype, runs=runs, zero_copy=False,
                            )
                            directs.append(
                                _DirectItem(
                                    write=write, candidates=cands, nbytes=nbytes, boxes=boxes,  # type: ignore[arg-type]
                                    offloaded=offl, src_itemsize=isz,
                                )
                            )
                            if template is not None:
                                template.append(
                                    (p.source, chunk, dbox, runs, nbytes, cands, boxes, offl, isz)
                                )
                if template is not None:
                    direct_cache[dkey] = template
            else:
                assert rc.quant is not None
                st = tensors[rc.quant.scale_dest]
                qkey = (id(rc), dt.shape, dt.region, dt.offset_bytes, st.shape, st.region,
                        st.offset_bytes)
                units_t = quant_cache.get(qkey)
                if units_t is None:
                    units_t = quant_cache[qkey] = _quant_units(rc, dt, st, table)
                for ubox, sbox, parts, names, wruns, sruns, local in units_t:
                    w = QuantWrite(
                        engine=d.engine, dest=rc.dest, scale_dest=st.name, block=rc.quant.block,
                        parts=parts, dest_box=ubox, scale_box=sbox,  # type: ignore[arg-type]
                        weight_runs=wruns, scale_runs=sruns,  # type: ignore[arg-type]
                    )
                    if local is not None:
                        key = ((local,), names)  # type: ignore[assignment]
                        gather_local_rank[key] = local  # type: ignore[assignment,index]
                        gather_units[key].append(w)
                        continue
                    if names not in pending:
                        cands = _common_gather_meshes([table[n] for n in names])  # type: ignore[attr-defined]
                        if not cands:
                            meshes = {_gather_mesh(table[n], problems) for n in names}  # type: ignore[attr-defined]
                            problems.append(
                                f"engine {d.engine!r}: {rc.dest!r} needs sources on different "
                                f"meshes ({sorted(str(m) for m in meshes)}); cannot gather them "
                                "together"
                            )
                            continue
                        pending_meshes[names] = cands  # type: ignore[index]
                    pending[names].append(w)  # type: ignore[index]
    if problems:
        raise PlanMismatchError(problems)
    # Sources replicated on several disjoint meshes (HSDP) can be gathered on any of them: pick
    # the least-loaded one per source set, largest sets first, so replicas share the work.
    mesh_load: dict[tuple[int, ...], int] = defaultdict(int)
    order = sorted(pending, key=lambda n: (-sum(u.nbytes for u in pending[n]), n))
    for names in order:
        cands = pending_meshes[names]
        mesh = min(cands, key=lambda m: (mesh_load[m] / len(m), m)) if len(cands) > 1 else cands[0]
        units = pending[names]
        mesh_load[mesh] += sum(u.nbytes for u in units)
        gather_units[(mesh, names)].extend(units)

    load = [0] * world
    # Gathers first (their units can go to any mesh rank), largest units first.
    for key in sorted(gather_units):
        mesh, names = key
        units = gather_units[key]
        local = key in gather_local_rank
        scratch = 0 if local else sum(
            numel(table[n].shape) * dtype_size(table[n].dtype) for n in names
        )
        assembly = max(numel(box_shape(u.dest_box)) for u in units) * 4
        scratch += assembly
        g = _Gather(mesh=mesh, sources=names, scratch_bytes=scratch, units=[], local=local)
        # min over the sorted mesh returns the lowest rank among equally loaded ones.
        ranks_sorted = sorted(mesh)
        for u in sorted(units, key=lambda u: (-u.nbytes, u.engine, u.dest, u.dest_box)):
            r = min(ranks_sorted, key=load.__getitem__)
            load[r] += u.nbytes
            g.units.append((u, r))
        gathers[key] = g
    for it in sorted(directs, key=lambda it: (-it.nbytes, it.write.engine, it.write.dest, it.write.dest_box)):
        r = min(it.candidates, key=load.__getitem__)  # candidates are sorted
        it.assigned = r
        load[r] += it.nbytes

    for g in gathers.values():
        need = g.scratch_bytes + max(
            (sum(u.nbytes for u, r in g.units if r == rank) for rank in g.mesh), default=0
        )
        if need > config.memory_budget_bytes:
            problems.append(
                f"gathering {list(g.sources)} needs {need} bytes of temporary memory, more than "
                f"memory_budget_bytes={config.memory_budget_bytes}"
            )
    if problems:
        raise PlanMismatchError(problems)

    # Mesh groups: greedy colouring of meshes so that meshes of one group share no rank.
    mesh_list = sorted({g.mesh for g in gathers.values() if not g.local}, key=lambda m: (-len(m), m))
    groups: list[list[tuple[int, ...]]] = []
    mesh_group: dict[tuple[int, ...], int] = {}
    for m in mesh_list:
        for gi, members in enumerate(groups):
            if all(not set(m) & set(o) for o in members):
                members.append(m)
                mesh_group[m] = gi
                break
        else:
            mesh_group[m] = len(groups)
            groups.append([m])
    num_groups = max(1, len(groups))

    per_rank: list[list[Task]] = [[] for _ in range(world)]
    next_id = 0
    # Gather tasks, in one global order, so every rank of a mesh sees the same sequence.
    for key in sorted(gathers, key=lambda k: (mesh_group.get(gathers[k].mesh, 0), k)):
        g = gathers[key]
        group = mesh_group.get(g.mesh, 0)
        for rank in g.mesh:
            mine = tuple(u for u, r in g.units if r == rank)
            if g.local and not mine:
                continue
            per_rank[rank].append(
                Task(
                    task_id=next_id,
                    kind="direct" if g.local else "gather",
                    mesh_group=group,
                    mesh=g.mesh,
                    gather=g.sources,
                    writes=mine,
                    staging_bytes=sum(u.nbytes for u in mine),
                    scratch_bytes=g.scratch_bytes if (mine or not g.local) else 0,
                    h2d_bytes=0,
                )
            )
        next_id += 1

    # Direct writes: per rank, interleave engines, batch small writes into tasks.
    by_rank: dict[int, list[_DirectItem]] = defaultdict(list)
    for it in directs:
        by_rank[it.assigned].append(it)
    engines = sorted(d.engine for d in dests)
    for rank in range(world):
        items = by_rank.get(rank, [])
        queues: dict[str, list[_DirectItem]] = defaultdict(list)
        for it in sorted(items, key=lambda it: (it.write.dest, it.write.dest_box)):
            queues[it.write.engine].append(it)
        order: list[_DirectItem] = []
        rot = engines[rank % len(engines):] + engines[: rank % len(engines)]
        while any(queues.values()):
            for e in rot:
                if queues[e]:
                    order.append(queues[e].pop(0))
        batch: list[SliceWrite] = []
        staging = h2d = 0
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, staging, h2d, batch_bytes, next_id
            if batch:
                per_rank[rank].append(
                    Task(
                        task_id=next_id, kind="direct", mesh_group=0, mesh=(rank,), gather=(),
                        writes=tuple(batch), staging_bytes=staging, scratch_bytes=0, h2d_bytes=h2d,
                    )
                )
                next_id += 1
            batch, staging, h2d, batch_bytes = [], 0, 0, 0

        for it in order:
            w = it.write
            lb = it.boxes.get(rank)
            zero = False
            if lb is not None and len(w.runs) == 1 and table[w.source].dtype == w.dtype:
                local = tuple((a - o, b - o) for (a, b), (o, _) in zip(w.source_box, lb, strict=True))
                zero = is_contiguous_box(box_shape(lb), local)
            w = dataclasses.replace(w, zero_copy=zero)
            cost = 0 if zero else it.nbytes
            if batch and (batch_bytes + it.nbytes > config.task_target_bytes or staging + cost > config.memory_budget_bytes // 2):
                flush()
            batch.append(w)
            staging += cost
            batch_bytes += it.nbytes
            if it.offloaded.get(rank, False):
                h2d += numel(box_shape(w.source_box)) * it.src_itemsize
        flush()

    # Spread direct tasks between gather tasks so writes overlap the collectives.
    for rank in range(world):
        tasks = per_rank[rank]
        gath = [t for t in tasks if t.kind == "gather"]
        direct = [t for t in tasks if t.kind == "direct"]
        merged: list[Task] = []
        if gath:
            step = max(1, -(-len(direct) // (len(gath) + 1)))
            di = 0
            for t in gath:
                merged.extend(direct[di:di + step])
                di += step
                merged.append(t)
            merged.extend(direct[di:])
            # Keep groups in order: a barrier separates them, so stable-sort by group.
            merged.sort(key=lambda t: t.mesh_group)
        else:
            merged = direct
        per_rank[rank] = merged

    # Version word writers: the rank that sends least among those writing to each engine.
    senders_of: dict[str, set[int]] = defaultdict(set)
    for rank in range(world):
        for t in per_rank[rank]:
            for w in t.writes:
                senders_of[w.engine].add(rank)
    version_engines: dict[int, list[str]] = defaultdict(list)
    vload = list(load)
    for e in engines:
        cands = sorted(senders_of.get(e, set())) or list(range(world))
        r = min(cands, key=lambda r: (vload[r], r))
        vload[r] += 1
        version_engines[r].append(e)

    bytes_per_engine = {e: 0 for e in engines}
    ranks_out = []
    for rank in range(world):
        peers = sorted({w.engine for t in per_rank[rank] for w in t.writes} | set(version_engines[rank]))
        for t in per_rank[rank]:
            for w in t.writes:
                bytes_per_engine[w.engine] += w.nbytes
        ranks_out.append(
            RankSchedule(
                rank=rank, tasks=tuple(per_rank[rank]), peers=tuple(peers),
                version_engines=tuple(version_engines[rank]), num_mesh_groups=num_groups,
            )
        )
    return Schedule(
        format_version=FORMAT_VERSION,
        fingerprint=fingerprint(sources, dests, config),
        num_ranks=world,
        engines=tuple(engines),
        num_mesh_groups=num_groups,
        ranks=tuple(ranks_out),
        bytes_per_rank=tuple(sum(t.nbytes for t in r.tasks) for r in ranks_out),
        bytes_per_engine=tuple(bytes_per_engine[e] for e in engines),
    )


def _gather_mesh(src: _Source, problems: list[str]) -> tuple[int, ...] | None:
    meshes = sorted({h.mesh for h in src.holders}, key=lambda m: (-len(m), m))
    if not meshes:
        problems.append(f"tensor {src.name!r}: no trainer rank holds it")
        return None
    return meshes[0]


def _quant_units(
    rc: Recipe, dt: DestTensor, st: DestTensor, table: dict[str, _Source]
) -> list[tuple[object, ...]]:
    """Quantization units of an FP8 recipe (one per leading index): boxes, clipped parts,
    source names, weight and scale runs, and the rank holding all of it locally (or None)."""
    assert rc.quant is not None
    lead = dt.shape[:-2]
    unit_boxes: list[tuple[Box, Box]] = []
    if lead:
        for flat in range(numel(lead)):
            idx = []
            rem = flat
            for n in reversed(lead):
                idx.append(rem % n)
                rem //= n
            idx.reverse()
            prefix = tuple((i, i + 1) for i in idx)
            unit_boxes.append(
                (prefix + ((0, dt.shape[-2]), (0, dt.shape[-1])),
                 prefix + ((0, st.shape[-2]), (0, st.shape[-1])))
            )
    else:
        unit_boxes.append((tuple((0, n) for n in dt.shape), tuple((0, n) for n in st.shape)))
    out: list[tuple[object, ...]] = []
    for ubox, sbox in unit_boxes:
        parts = tuple(c for c in (_clip_part_to_dest(p, ubox) for p in rc.parts) if c is not None)
        names = tuple(sorted({p.source for p in parts}))
        out.append((
            ubox, sbox, parts, names,
            dest_runs(dt.shape, ubox, 1, dt.offset_bytes, dt.region),
            dest_runs(st.shape, sbox, 4, st.offset_bytes, st.region),
            _local_holder(parts, table),
        ))
    return out


def _common_gather_meshes(srcs: Sequence[_Source]) -> list[tuple[int, ...]]:
    """Meshes on which every source of `srcs` can be rebuilt with one `full_tensor()`.

    A source's gather meshes are its largest meshes; several when it is replicated over
    disjoint shard groups (HSDP). Sorted; empty when the sources share none.
    """
    common: set[tuple[int, ...]] | None = None
    for src in srcs:
        meshes = {h.mesh for h in src.holders}
        if not meshes:
            return []
        size = max(len(m) for m in meshes)
        best = {m for m in meshes if len(m) == size}
        common = best if common is None else common & best
    return sorted(common or ())


def _local_holder(parts: Sequence[Part], table: dict[str, _Source]) -> int | None:
    """A rank whose own shards contain every part's source box, if any (no gather needed)."""
    common: set[int] | None = None
    for p in parts:
        ranks = {
            h.rank for b, hs in table[p.source].by_box().items()
            if box_in(p.source_box, b) for h in hs
        }
        common = ranks if common is None else common & ranks
        if not common:
            return None
    return min(common) if common else None


def fingerprint(
    sources: Sequence[SourceManifest], dests: Sequence[DestManifest], config: PlannerConfig
) -> str:
    """sha256 of the canonical encoding of the planner's inputs.

    The bytes are msgpack of ``[[source manifests], [dest manifests], config]`` as
    `codec.to_plain` gives them, packed piecewise (msgpack concatenates) so that 10^6-entry
    manifests are neither copied into plain data nor held as one buffer.
    """
    h = hashlib.sha256()
    packer = msgpack.Packer(use_bin_type=True)
    h.update(packer.pack_array_header(3))
    memo: dict[int, object] = {}
    for group in (sorted(sources, key=lambda m: m.rank), sorted(dests, key=lambda d: d.engine)):
        h.update(packer.pack_array_header(len(group)))
        for m in group:
            h.update(packer.pack(_fast_plain(m, memo)))
    h.update(packer.pack(codec.to_plain(config)))
    return h.hexdigest()


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _fast_plain(value: object, memo: dict[int, object]) -> object:
    """`codec.to_plain` for manifests, msgpack-equal (tuples stay tuples), memoising shared
    tuples by identity (the caller keeps them alive for the memo's lifetime)."""
    t = type(value)
    if value is None or t in (int, str, bytes, bool, float):
        return value
    if t is tuple or t is list:
        seq: tuple[object, ...] | list[object] = value  # type: ignore[assignment]
        if all(type(x) is int or type(x) is str for x in seq):
            return seq
        key = id(seq)
        got = memo.get(key)
        if got is None:
            got = memo[key] = [_fast_plain(x, memo) for x in seq]
        return got
    names = _FIELD_NAMES.get(t)
    if names is None:
        if not dataclasses.is_dataclass(value):
            return codec.to_plain(value)
        names = _FIELD_NAMES[t] = tuple(f.name for f in dataclasses.fields(value))
    return {n: _fast_plain(getattr(value, n), memo) for n in names}


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
