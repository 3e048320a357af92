"""FP8 graph groups (CUDA only): local quantization tasks captured once as CUDA graphs.

When every task that is not static only quantizes block-aligned parts of sources this rank
holds, each group of consecutive such tasks gets a fixed slice of the staging arena (a ring:
groups are admitted and released in order) and its kernels are captured once as a CUDA graph,
so an update replays one graph per group instead of re-issuing every launch from Python. A
unit whose engine memory the transport maps on this GPU (`Transport.mapped_view`) is quantized
straight into that memory (a mapped unit) and takes no staging. Whether this applies is decided
once, at construction (`GraphGroups.capture`); otherwise every task is prepared eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Container, Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backends.base import (
    PreparedWrites,
    RegionDescriptor,
    Transport,
    WeightTransferError,
    WriteOp,
)
from weight_transfer.pipeline.geometry import (
    AlignedPart,
    block_aligned_parts,
    ops_for_runs,
    round_up,
    slices,
)
from weight_transfer.pipeline.quant import QuantCall, QuantFn, quantize_launches, table_tensors
from weight_transfer.pipeline.records import TaskRecord
from weight_transfer.pipeline.sources import PointerCheck, Sources
from weight_transfer.pipeline.staging import Staging, StagingArena
from weight_transfer.pipeline.state import Prepared
from weight_transfer.planner.types import QuantWrite, Task, box_shape, numel, staging_key

log = logging.getLogger(__name__)

GROUP_BYTES = 1 << 30
"""Output bytes of one captured graph group, at most (unless one task is larger)."""
GROUP_CALLS = 4096
"""Quantize kernels in one captured graph group, at most (unless one task has more)."""


class NotGraphable(Exception):
    """Why graph groups do not apply to a schedule (the executor then prepares eagerly)."""


@dataclasses.dataclass(frozen=True, slots=True)
class UnitLayout:
    """Where one quantized unit of a group goes: staged in the group's arena slice, or mapped."""

    write: QuantWrite
    parts: list[AlignedPart]
    weight_offset: int
    """Its FP8 weight's offset inside the task's (later: the group's) slice of the arena."""
    scale_offset: int
    """Its scales' offset, likewise."""
    mapped: tuple[torch.Tensor, torch.Tensor] | None
    """Its weight and scales as views of the engine's own memory, or None (staged)."""
    quantized: bool = True
    """False for another engine replica's copy of a unit staged earlier in the task: its
    writes read that unit's staging, and it is not quantized again."""


@dataclasses.dataclass(frozen=True, slots=True)
class TaskLayout:
    """One local quantization task laid out for capture."""

    task: Task
    staged_bytes: int
    """Arena bytes its staged units take."""
    units: list[UnitLayout]
    out_bytes: int
    """FP8 weight bytes it produces (staged or mapped)."""
    num_calls: int
    """Quantize calls it makes."""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPlan:
    """Consecutive tasks captured as one graph into the arena slice [start, start + nbytes)."""

    members: list[TaskLayout]
    start: int
    nbytes: int


@dataclasses.dataclass(slots=True)
class GraphGroup:
    """Consecutive local-quantization tasks replayed as one CUDA graph into one ring slice."""

    graph: Any
    """torch.cuda.CUDAGraph."""
    ops: dict[str, list[WriteOp]]
    start: int
    end: int
    """The group's slice [start, end) of the staging arena."""
    sources: tuple[str, ...]
    nbytes: int
    prepared: dict[str, PreparedWrites] = dataclasses.field(default_factory=dict)
    """Its write batches, prepared on first post."""
    keep: tuple[torch.Tensor, ...] = ()
    """Tensors its graph reads or writes that nothing else holds: engine memory it writes
    straight into (kept mapped while the graph lives) and its quantize tables."""
    fast_check: PointerCheck | None = None
    """Its sources' addresses at capture (see `PointerCheck`)."""


class GraphGroups:
    """The captured groups of a schedule, by the id of each group's first task."""

    def __init__(self, groups: dict[int, GraphGroup], skip: set[int]) -> None:
        self.groups = groups
        self.skip = skip
        """Tasks replayed by the graph of an earlier task."""

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.groups

    def get(self, task_id: int) -> GraphGroup | None:
        """The group whose first task is `task_id`, if any."""
        return self.groups.get(task_id)

    @staticmethod
    def capture(
        *,
        rank: int,
        tasks: Sequence[Task],
        static: Container[int],
        sources: Sources,
        descriptors: Mapping[str, Sequence[RegionDescriptor]],
        transport: Transport,
        arena: StagingArena,
        device: torch.device,
        stream: Any,
        quantize: QuantFn,
        mapped_writes: bool,
        table_quantize: bool,
        group_budget_bytes: int | None = None,
    ) -> GraphGroups:
        """Lay out and capture every task whose id is not in `static`.

        `group_budget_bytes` (default: the arena's size) sets how large a group's ring slice
        may grow (an eighth of it, at most 128 MiB): the executor passes half the memory
        budget, so groups do not shrink when the arena is sized to what the schedule stages.

        Raises:
            NotGraphable: some such task is not a local quantization of whole blocks.
            RuntimeError: capture refused (driver, allocator), or a source was reallocated.
        """
        todo = [t for t in tasks if t.task_id not in static]
        if not todo:
            raise NotGraphable("no task needs preparation")
        per_task = [
            _lay_out(t, rank, sources, descriptors, transport, arena, device, mapped_writes)
            for t in todo
        ]
        groups: dict[int, GraphGroup] = {}
        skip: set[int] = set()
        budget = arena.nbytes if group_budget_bytes is None else group_budget_bytes
        for plan in _plan_groups(per_task, arena.nbytes, budget):
            groups[plan.members[0].task.task_id] = _capture_group(
                plan, sources, descriptors, arena, stream, quantize, table_quantize
            )
            for m in plan.members[1:]:
                skip.add(m.task.task_id)
        return GraphGroups(groups, skip)

    def replay(
        self,
        task: Task,
        rec: TaskRecord,
        t0: float,
        deadline: float,
        abort: threading.Event,
        *,
        staging: Staging,
        sources: Sources,
        stream: Any,
    ) -> Prepared | None:
        """Replay the group of `task` into its ring slice once no task in flight owns any of
        it. None if `abort` was set while waiting."""
        group = self.groups[task.task_id]
        rec.nbytes = group.nbytes
        rec.admit = time.perf_counter() - t0
        if not staging.claim_slice(task, group.start, group.end, deadline, abort):
            return None
        # The graph reads the addresses its parameters had at capture: fail if one moved. A
        # MoE layer's group reads hundreds of expert parameters, compared as one list.
        fast = group.fast_check
        moved = fast.moved() if fast is not None else None
        if moved is not None:
            raise WeightTransferError(
                f"trainer rank {sources.rank}: parameter {group.sources[moved]!r} was "
                "reallocated since the sender captured its quantization (its address changed); "
                "update parameters in place, or build a new WeightSender after changing their "
                "storage"
            )
        if fast is None:  # a mix of DTensors and plain tensors: one by one
            for n in group.sources:
                sources.local(n)
        rec.prepare_start = time.perf_counter() - t0
        with torch.cuda.stream(stream):
            group.graph.replay()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record(stream)
        rec.prepare_end = time.perf_counter() - t0
        return Prepared(task, rec, group.ops, [], 0, event, ring=True)


def _lay_out(
    t: Task,
    rank: int,
    sources: Sources,
    descriptors: Mapping[str, Sequence[RegionDescriptor]],
    transport: Transport,
    arena: StagingArena,
    device: torch.device,
    mapped_writes: bool,
) -> TaskLayout:
    """Where each unit of a local quantization task goes (raises `NotGraphable` otherwise)."""
    if t.kind != "direct" or not t.gather or not all(isinstance(w, QuantWrite) for w in t.writes):
        raise NotGraphable(f"task {t.task_id} is not a local quantization")
    for n in t.gather:
        local = sources.local(n)
        if local.device != device:
            raise NotGraphable(f"source {n!r} is not on {device}")
    size = work = ncalls = 0
    units = []
    staged: dict[tuple[object, ...], UnitLayout] = {}  # as `PrepareStage` stages replicas
    for w in t.writes:
        assert isinstance(w, QuantWrite)
        shape = box_shape(w.dest_box)
        aligned = block_aligned_parts(w, shape, [a for a, _ in w.dest_box])
        if aligned is None:
            raise NotGraphable(f"task {t.task_id}: {w.dest} has parts inside one block")
        wb = round_up(numel(shape))
        sb = round_up(numel(box_shape(w.scale_box)) * 4)
        mapped = mapped_views(w, rank, descriptors, transport, device) if mapped_writes else None
        key = staging_key(w)
        assert key is not None
        first = staged.get(key)
        if mapped is None and first is not None:
            units.append(
                UnitLayout(w, aligned, first.weight_offset, first.scale_offset, None, False)
            )
            continue
        unit = UnitLayout(w, aligned, size, size + wb, mapped)
        units.append(unit)
        if mapped is None:  # written straight into the engine: no staging needed
            staged[key] = unit
            size += wb + sb
        work += wb
        ncalls += len(aligned)
    if size > arena.nbytes:
        raise NotGraphable(f"task {t.task_id} needs {size} bytes, more than the arena")
    return TaskLayout(t, size, units, work, ncalls)


def _plan_groups(
    per_task: Sequence[TaskLayout], arena_bytes: int, budget_bytes: int
) -> list[GroupPlan]:
    """Consecutive small tasks share one graph, one ring slice and one batch per engine, so
    a MoE layer's hundreds of expert units cost a few replays and posts, not hundreds.
    Mapped units take no ring space; a group also closes at `GROUP_BYTES` of output or
    `GROUP_CALLS` kernels, so the write stage still sees progress and graphs stay small."""
    group_limit = max(1, min(arena_bytes, budget_bytes // 8, 128 << 20))
    groups: list[list[TaskLayout]] = []
    staged = out = calls = 0  # of the open group
    for item in per_task:
        if groups and (
            staged + item.staged_bytes <= group_limit
            and out + item.out_bytes <= GROUP_BYTES
            and calls + item.num_calls <= GROUP_CALLS
        ):
            groups[-1].append(item)
            staged, out, calls = (
                staged + item.staged_bytes,
                out + item.out_bytes,
                calls + item.num_calls,
            )
        else:
            groups.append([item])
            staged, out, calls = item.staged_bytes, item.out_bytes, item.num_calls
    plans = []
    pos = 0
    for members in groups:
        size = sum(m.staged_bytes for m in members)
        if pos + size > arena_bytes:
            pos = 0
        plans.append(GroupPlan(members, pos, size))
        pos += size
    return plans


def _capture_group(
    plan: GroupPlan,
    sources: Sources,
    descriptors: Mapping[str, Sequence[RegionDescriptor]],
    arena: StagingArena,
    stream: Any,
    quantize: QuantFn,
    table_quantize: bool,
) -> GraphGroup:
    """Capture one group's quantize calls as a CUDA graph and build its writes."""
    start = plan.start
    calls: list[QuantCall] = []
    keep: list[torch.Tensor] = []
    ops: dict[str, list[WriteOp]] = defaultdict(list)
    units: list[UnitLayout] = []
    base = start
    for member in plan.members:
        shift = base - start  # the task's offset inside the group's slice
        units += [
            dataclasses.replace(
                u, weight_offset=shift + u.weight_offset, scale_offset=shift + u.scale_offset
            )
            for u in member.units
        ]
        base += member.staged_bytes
    for u in units:
        w = u.write
        shape = box_shape(w.dest_box)
        sshape = box_shape(w.scale_box)
        if u.mapped is not None:
            q, sc = u.mapped  # quantize straight into the engine's memory: no staging
        else:
            q = (
                arena.view(start + u.weight_offset, numel(shape))
                .view(torch.float8_e4m3fn)
                .view(shape[-2], shape[-1])
            )
            sc = (
                arena.view(start + u.scale_offset, numel(sshape) * 4)
                .view(torch.float32)
                .view(sshape[-2], sshape[-1])
            )
        b0, b1 = w.block
        if u.quantized:  # not another replica's copy of a unit already quantized
            for a in u.parts:
                src = sources.local_as_global(a.part.source)[slices(a.part.source_box)].reshape(
                    a.row1 - a.row0, a.col1 - a.col0
                )
                calls.append(
                    QuantCall(
                        src,
                        w.block,
                        q[a.row0 : a.row1, a.col0 : a.col1],
                        sc[a.row0 // b0 : -(-a.row1 // b0), a.col0 // b1 : -(-a.col1 // b1)],
                    )
                )
        if u.mapped is not None:
            keep += [q, sc]
            continue
        descs = descriptors[w.engine]
        ops_for_runs(descs, w.weight_runs, arena.region, start + u.weight_offset, ops[w.engine])
        ops_for_runs(descs, w.scale_runs, arena.region, start + u.scale_offset, ops[w.engine])
    assert stream is not None
    launches = quantize_launches(calls, quantize, table=table_quantize)
    with torch.cuda.stream(stream):
        for launch in launches:  # compile and warm up outside the capture
            launch()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for launch in launches:
            launch()
    keep += table_tensors(launches)
    names = tuple(sorted({n for m in plan.members for n in m.task.gather}))
    return GraphGroup(
        graph,
        dict(ops),
        start,
        start + plan.nbytes,
        names,
        sum(m.task.nbytes for m in plan.members),
        keep=tuple(keep),
        fast_check=sources.pointer_check(names),
    )


def mapped_views(
    w: QuantWrite,
    rank: int,
    descriptors: Mapping[str, Sequence[RegionDescriptor]],
    transport: Transport,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The unit's weight and scale as views of the engine's own memory, where the transport
    maps it on this GPU and each is one contiguous run; else None (staged and written)."""
    if len(w.weight_runs) != 1 or len(w.scale_runs) != 1:
        return None
    shape, sshape = box_shape(w.dest_box), box_shape(w.scale_box)
    wr, sr = w.weight_runs[0], w.scale_runs[0]
    if wr.nbytes != numel(shape) or sr.nbytes != numel(sshape) * 4:
        return None
    descs = descriptors[w.engine]
    try:
        qv = transport.mapped_view(w.engine, descs[wr.region], wr.offset_bytes, wr.nbytes, device)
        sv = transport.mapped_view(w.engine, descs[sr.region], sr.offset_bytes, sr.nbytes, device)
    except (ValueError, WeightTransferError) as exc:  # e.g. not connected yet: stage it
        log.info("trainer rank %d: %s staged, no mapped view: %s", rank, w.dest, exc)
        return None
    if qv is None or sv is None:
        return None
    try:
        q = qv.view(torch.float8_e4m3fn).view(shape[-2], shape[-1])
        s = sv.view(torch.float32).view(sshape[-2], sshape[-1])
    except RuntimeError:  # a view the dtype cannot take (alignment): stage it instead
        return None
    return q, s
