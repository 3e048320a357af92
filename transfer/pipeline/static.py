"""Static tasks: tasks that only send straight from registered shards. Their writes are the
same every update, so they are built once, grouped per engine into prepared batches
(`Transport.prepare_writes`) and posted before anything else, with no preparation."""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

from weight_transfer.backends.base import (
    PreparedWrites,
    RegionDescriptor,
    Transport,
    WriteHandle,
    WriteOp,
)
from weight_transfer.pipeline.geometry import ops_for_runs, slices
from weight_transfer.pipeline.records import TaskRecord
from weight_transfer.pipeline.sources import Sources, UnmovedCheck
from weight_transfer.pipeline.state import InFlight, Prepared, RunState
from weight_transfer.planner.types import RankSchedule, SliceWrite, Task

STATIC_BATCH_BYTES = 1 << 30
"""Static tasks' writes to one engine are posted in prepared batches of about this size."""


@dataclasses.dataclass(frozen=True, slots=True)
class StaticTask:
    """A task that sends straight from registered shards: the same writes every update."""

    sources: tuple[str, ...]
    """Parameters it reads (checked for reallocation before each update)."""
    ops: dict[str, list[WriteOp]]


@dataclasses.dataclass(slots=True)
class StaticBatch:
    """Consecutive static tasks' writes to one engine, posted as one prepared batch."""

    peer: str
    task_ids: tuple[int, ...]
    ops: list[WriteOp]
    sources: list[str] = dataclasses.field(default_factory=list)
    """Parameters its writes read (checked right before it is posted)."""
    prepared: PreparedWrites | None = None


def static_ops(
    task: Task, sources: Sources, descriptors: Mapping[str, Sequence[RegionDescriptor]]
) -> dict[str, list[WriteOp]] | None:
    """The writes of a task that only sends straight from registered shards: the same
    every update, so built once (a prepared descriptor list). None for any other task."""
    if task.gather or not task.writes:
        return None
    ops: dict[str, list[WriteOp]] = defaultdict(list)
    for w in task.writes:
        if not isinstance(w, SliceWrite) or not w.zero_copy:
            return None
        b = sources.bindings[w.source]
        if b.region is None or b.local_box is None:
            return None
        local = sources.local(w.source)
        origin = [a for a, _ in b.local_box]
        src = local[slices(w.source_box, origin)]
        ops_for_runs(
            descriptors[w.engine],
            w.runs,
            b.region,
            src.data_ptr() - b.region.address,
            ops[w.engine],
        )
    return dict(ops)


def static_batches(tasks: Sequence[Task], static: Mapping[int, StaticTask]) -> list[StaticBatch]:
    """Static tasks' writes grouped per engine, in task order, into batches of about
    `STATIC_BATCH_BYTES` (one prepared batch each instead of one post per task)."""
    open_: dict[str, StaticBatch] = {}
    sizes: dict[str, int] = {}
    out: list[StaticBatch] = []
    owned: set[int] = set()  # each task's record goes with the first batch holding its writes
    batch_names: dict[int, set[str]] = {}
    for t in tasks:
        st = static.get(t.task_id)
        if st is None:
            continue
        for peer, ops in st.ops.items():
            batch = open_.get(peer)
            if batch is None or sizes[peer] >= STATIC_BATCH_BYTES:
                batch = open_[peer] = StaticBatch(peer, (), [])
                sizes[peer] = 0
                out.append(batch)
            if t.task_id not in owned:
                owned.add(t.task_id)
                batch.task_ids += (t.task_id,)
            batch.ops.extend(ops)
            for n in st.sources:
                if n not in batch_names.setdefault(id(batch), set()):
                    batch_names[id(batch)].add(n)
                    batch.sources.append(n)
            sizes[peer] += sum(op.nbytes for op in ops)
    return out


class StaticWrites:
    """A schedule's static tasks, batched once, posted at the start of every update."""

    def __init__(
        self,
        schedule: RankSchedule,
        sources: Sources,
        descriptors: Mapping[str, Sequence[RegionDescriptor]],
    ) -> None:
        self.schedule = schedule
        self._task_by_id = {t.task_id: t for t in schedule.tasks}
        self.tasks: dict[int, StaticTask] = {}
        for t in schedule.tasks:
            ops = static_ops(t, sources, descriptors)
            if ops is not None:
                names = tuple(sorted({w.source for w in t.writes if isinstance(w, SliceWrite)}))
                self.tasks[t.task_id] = StaticTask(names, ops)
        self.batches = static_batches(schedule.tasks, self.tasks)
        self.names = sorted({n for st in self.tasks.values() for n in st.sources})
        """Every parameter the batches read."""
        self._unmoved = UnmovedCheck(sources, self.names)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.tasks

    def post(self, st: RunState, transport: Transport) -> None:
        """Check that no parameter moved, then post every batch (in flight before posting:
        a failed post leaves the batches posted before it to be waited for)."""
        now = time.perf_counter() - st.t0
        first_update = not self._unmoved.ever_checked
        if first_update:
            self._unmoved.check()
        for batch in self.batches:
            if batch.prepared is None:
                batch.prepared = transport.prepare_writes(batch.peer, batch.ops)
            recs = []
            for tid in batch.task_ids:
                task = self._task_by_id[tid]
                recs.append(TaskRecord(tid, task.kind, task.nbytes, now, now, now, now))
            first = (
                self._task_by_id[batch.task_ids[0]] if batch.task_ids else self.schedule.tasks[0]
            )
            rec = recs[0] if recs else TaskRecord(first.task_id, first.kind, 0)
            p = Prepared(first, rec, {batch.peer: batch.ops}, [], 0, None)
            handles: list[WriteHandle] = []
            st.in_flight.append(InFlight(p, handles, recs))
            t_post = time.perf_counter()
            handles.append(transport.post_prepared(batch.prepared))
            st.post_seconds += time.perf_counter() - t_post
            st.num_writes += len(batch.ops)
        if not first_update:
            # After the first update the check runs while the copies run: a parameter that
            # moved since then is still registered (its Region keeps the old memory alive),
            # so reading it is safe, and raising here fails the update before any commit.
            self._unmoved.check()
