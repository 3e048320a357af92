"""The per-rank executor: replays a `RankSchedule` as a pipeline of prepare and write stages.

Stages are FIFO queues of tasks. The prepare stage (its own thread) admits a task only while the
temporary memory of tasks in flight fits the budget, rebuilds gathered tensors with
`full_tensor()` (every rank of a mesh runs the same gathers in the same order), copies, casts,
fuses and quantizes into a fixed, registered staging arena, and hands the task on. Host-to-device
copies of CPU-offloaded shards happen inside that packing copy (on CUDA it is an asynchronous
copy from pinned memory, ordered by a CUDA event rather than a synchronize). The write stage
(the calling thread, which alone drives the transport) waits for a task's event, posts its
writes as one batch per engine, polls completions, and only then returns the task's staging
memory: a source buffer is never reused before its writes completed.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backends.base import (
    Region,
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportTimeoutError,
    UpdateAbortedError,
    WeightTransferError,
    WriteHandle,
    WriteOp,
)
from weight_transfer.planner.types import (
    Box,
    QuantWrite,
    RankSchedule,
    SliceWrite,
    Task,
    WriteRun,
    box_shape,
    numel,
)
from weight_transfer.transfer.manifest import torch_dtype

log = logging.getLogger(__name__)

_ALIGN = 256
_EVENT_SLICE_S = 1e-4
"""Longest the write loop sleeps on a batch's completion event before it looks for newly
prepared tasks again."""


_CANCEL_POLL_S = 0.02
"""How often the write loop asks whether another rank failed."""
_QUIESCE_S = 1.0
"""After a failure, longest the write stage waits for writes in flight to settle before it
quarantines their staging memory and reports."""


class _NotGraphable(Exception):
    """Why the ring/graph fast path does not apply to a schedule (internal)."""


class _CollectiveError(WeightTransferError):
    """A gather failed: its collective is broken, so the rank cannot drain the others."""


class StagingArena:
    """A fixed block of registered memory handed out first-fit; thread-safe."""

    def __init__(self, transport: Transport, nbytes: int, device: torch.device) -> None:
        self.nbytes = max(_ALIGN, nbytes)
        if device.type == "cuda":
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        else:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        # Touch every page now so the first update does not pay page faults.
        self.buffer.fill_(0)
        self.region: Region = transport.register(self.buffer, role=RegionRole.SOURCE)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]
        self._cond = threading.Condition()
        self.in_use = 0
        self.peak = 0

    def try_alloc(self, nbytes: int) -> int | None:
        """Offset of a free block of `nbytes` (aligned), or None if none fits now."""
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        with self._cond:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + need, size - need)
                    self.in_use += need
                    self.peak = max(self.peak, self.in_use)
                    return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a block."""
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        with self._cond:
            self._free.append((offset, need))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            self._free = merged
            self.in_use -= need
            self._cond.notify_all()

    def wait_change(self, timeout_s: float) -> None:
        """Sleep until a block is freed or the timeout passes."""
        with self._cond:
            self._cond.wait(timeout_s)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 slice of the arena at `offset`."""
        return self.buffer[offset:offset + nbytes]


@dataclasses.dataclass(slots=True)
class SourceBinding:
    """Where a trainer tensor's local shard lives, for packing and zero-copy writes."""

    param: torch.Tensor
    """The parameter as the trainer holds it (DTensor or plain)."""
    local_box: Box | None
    region: Region | None
    """Registered region covering the local shard's storage (zero-copy), if any."""
    storage_ptr: int
    """data_ptr of the storage when registered, to detect reallocation."""


@dataclasses.dataclass(slots=True)
class TaskRecord:
    """Stage times of one task in one update (seconds since the update started)."""

    task_id: int
    kind: str
    nbytes: int
    admit: float = 0.0
    prepare_start: float = 0.0
    prepare_end: float = 0.0
    write_start: float = 0.0
    write_end: float = 0.0


@dataclasses.dataclass(slots=True)
class _Prepared:
    task: Task
    record: TaskRecord
    ops: dict[str, list[WriteOp]]
    blocks: list[tuple[int, int]]
    scratch: int
    event: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateStats:
    """What one update did on one rank."""

    step: int
    seconds: float
    nbytes: int
    num_tasks: int
    peak_staging_bytes: int
    peak_scratch_bytes: int
    records: tuple[TaskRecord, ...]


GatherFn = Callable[[torch.Tensor], torch.Tensor]
BarrierFn = Callable[[int], None]
QuantFn = Callable[[torch.Tensor, tuple[int, int], torch.Tensor, torch.Tensor], None]


def _slices(box: Box, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin, strict=True))


def default_quantize(x: torch.Tensor, block: tuple[int, int], out_q: torch.Tensor, out_s: torch.Tensor) -> None:
    """Quantize into `out_q`/`out_s` with the GPU kernel on CUDA, else the reference."""
    if x.is_cuda:
        from weight_transfer.transfer.kernels.fp8_triton import quantize_fp8

        quantize_fp8(x, block, out_q=out_q, out_scale=out_s)
        return
    from weight_transfer.planner.fp8 import quantize_fp8_blockwise

    q, s = quantize_fp8_blockwise(x, block)
    out_q.copy_(q)
    out_s.copy_(s)


class Executor:
    """Runs one rank's schedule, update after update. Built once; `run` per update."""

    def __init__(
        self,
        *,
        rank: int,
        schedule: RankSchedule,
        transport: Transport,
        sources: Mapping[str, SourceBinding],
        descriptors: Mapping[str, Sequence[RegionDescriptor]],
        version_regions: Mapping[str, int],
        device: torch.device,
        memory_budget_bytes: int,
        gather: GatherFn,
        barrier: BarrierFn,
        quantize: QuantFn = default_quantize,
    ) -> None:
        self.rank = rank
        self.schedule = schedule
        self.transport = transport
        self.sources = sources
        self.descriptors = descriptors
        self.version_regions = version_regions
        self.device = device
        self.gather = gather
        self.barrier = barrier
        self.quantize = quantize
        arena_bytes = memory_budget_bytes // 2
        self.scratch_budget = memory_budget_bytes - arena_bytes
        too_big = [t for t in schedule.tasks if t.staging_bytes > arena_bytes]
        if too_big:
            t = too_big[0]
            raise WeightTransferError(
                f"trainer rank {rank}: task {t.task_id} needs {t.staging_bytes} staging bytes, "
                f"more than half the memory budget ({arena_bytes}); raise memory_budget_bytes "
                "or plan with a smaller max_write_bytes"
            )
        self.arena = StagingArena(transport, arena_bytes, device)
        self._version_buf = torch.zeros(max(1, len(schedule.version_engines)), dtype=torch.int64)
        self._version_region = transport.register(self._version_buf, role=RegionRole.SOURCE)
        self._scratch_in_use = 0
        self._scratch_peak = 0
        self._gathers_done = 0  # of the task being prepared (what a drain still owes)
        self._quarantine: list[tuple[_Prepared, list[WriteHandle]]] = []
        self._lock = threading.Lock()
        # torch.cuda.Stream/Event constructors are unannotated in torch's stubs.
        self._stream = (
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            if device.type == "cuda" else None
        )
        self._static: dict[int, tuple[tuple[str, ...], dict[str, list[WriteOp]]]] = {}
        for t in schedule.tasks:
            ops = self._static_ops(t)
            if ops is not None:
                self._static[t.task_id] = (tuple(sorted({w.source for w in t.writes if isinstance(w, SliceWrite)})), ops)
        self._static_sources = sorted({n for names, _ in self._static.values() for n in names})
        # Ring mode (CUDA): when every other task only quantizes block-aligned parts of sources
        # this rank holds, each task gets a fixed slice of the arena (a ring: tasks are admitted
        # and released in order) and its kernels are captured once as a CUDA graph, so an
        # update replays one graph per task instead of re-issuing every launch from Python.
        self._graphs: dict[int, tuple[Any, dict[str, list[WriteOp]], int, int, tuple[str, ...], int]] = {}
        self._graph_skip: set[int] = set()  # tasks replayed by the graph of an earlier task
        self._ring_busy: list[tuple[int, int, int]] = []  # (task_id, start, end) in flight
        self._ring_cond = threading.Condition()
        if self._stream is not None:
            try:
                self._graphs = self._capture_graphs()
            except _NotGraphable as why:
                log.info("trainer rank %d: per-task graphs not used: %s", rank, why)
                self._graphs = {}
                self._graph_skip = set()
            except RuntimeError as exc:  # capture refused (driver, allocator): run eagerly
                log.warning("trainer rank %d: CUDA graph capture failed, running eagerly: %s", rank, exc)
                self._graphs = {}
                self._graph_skip = set()
                torch.cuda.synchronize(device)

    # -- one update ------------------------------------------------------------------------

    def run(
        self,
        step: int,
        timeout_s: float,
        *,
        cancelled: Callable[[], str | None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> UpdateStats:
        """Replay the schedule once. Blocks until every write completed.

        On any failure (here, or another rank's, as `cancelled` reports it) the rank stops
        posting writes, waits for the writes already posted to finish or fail (staging memory
        a write may still read is never reused: what does not settle by the deadline stays
        quarantined until a later update sees it settled), and keeps entering the collectives
        of the rest of its schedule (gathers, mesh-group barriers) without preparing anything,
        so ranks of its meshes never wait out a timeout in a collective it skipped. A failed
        gather or barrier ends that: the collective itself is broken.

        Args:
            cancelled: polled about every 20 ms; a message when another rank failed.
            on_failure: called at once, before draining, with this rank's own error (the
                sender publishes it so the other ranks stop within a poll).

        Raises:
            TransportTimeoutError: the update ran past `timeout_s`.
            UpdateAbortedError: `cancelled` reported another rank's failure.
            WeightTransferError: a stage failed (the message names the task and peer); any
                other exception of a stage is raised as it is.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        self._settle_quarantine()
        if self._stream is not None:
            # Preparation reads parameters the caller's stream (the optimizer) last wrote.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self.arena.peak = self.arena.in_use
        self._scratch_peak = self._scratch_in_use
        ready: queue.Queue[_Prepared | BaseException | None] = queue.Queue()
        abort = threading.Event()
        records: list[TaskRecord] = []

        def drain(task: Task, gathers_done: int) -> None:
            """Enter the collectives of `task` that have not run yet; prepare nothing."""
            if task.kind == "gather":
                for name in task.gather[gathers_done:]:
                    self._gather(task, name)

        def prepare_loop() -> None:
            group = 0
            failed = False
            try:
                for task in self.schedule.tasks:
                    if task.task_id in self._static or task.task_id in self._graph_skip:
                        continue  # posted at the start, or part of an earlier task's graph
                    # Every rank enters every group's barrier, also groups it has no task in.
                    while group < task.mesh_group:
                        group += 1
                        self.barrier(group)
                    if failed or abort.is_set():
                        drain(task, 0)
                        continue
                    rec = TaskRecord(task.task_id, task.kind, task.nbytes)
                    self._gathers_done = 0
                    try:
                        if task.task_id in self._graphs:
                            prepared = self._replay(task, rec, t0, deadline, abort)
                        else:
                            prepared = self._admit_and_prepare(task, rec, t0, deadline, abort)
                    except _CollectiveError:
                        raise
                    except BaseException as exc:  # the write stage raises it; keep draining
                        ready.put(exc)
                        failed = True
                        drain(task, self._gathers_done)
                        continue
                    if prepared is None:  # aborted while waiting for memory
                        drain(task, self._gathers_done)
                        continue
                    ready.put(prepared)
                    # Let the write stage take the GIL now rather than at the next switch
                    # interval (5 ms), so writes start as soon as their task is ready.
                    time.sleep(0)
                while group < self.schedule.num_mesh_groups - 1:
                    group += 1
                    self.barrier(group)
                ready.put(None)
            except BaseException as exc:  # a broken collective: handed to the write stage
                ready.put(exc)

        in_flight: list[tuple[_Prepared, list[WriteHandle]]] = []
        waiting: list[_Prepared] = []
        finished_preparing = False
        total = 0
        # Tasks that send straight from registered shards need no preparation: check once that
        # no parameter moved, then post their prepared write lists before anything else.
        worker = threading.Thread(target=prepare_loop, name=f"wt-prepare-r{self.rank}", daemon=True)
        next_poll = 0.0
        try:
            for name in self._static_sources:
                self._local(name)
            for task in self.schedule.tasks:
                static = self._static.get(task.task_id)
                if static is None:
                    continue
                now = time.perf_counter() - t0
                rec = TaskRecord(task.task_id, task.kind, task.nbytes, now, now, now, now)
                handles: list[WriteHandle] = []
                # In flight before posting: a failed post leaves the batches posted before it
                # to be waited for.
                in_flight.append((_Prepared(task, rec, static[1], [], 0, None), handles))
                for peer, ops in static[1].items():
                    handles.append(self.transport.post_writes(peer, ops))
            worker.start()
            while not finished_preparing or waiting or in_flight:
                if cancelled is not None and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + _CANCEL_POLL_S
                    why = cancelled()
                    if why:
                        raise UpdateAbortedError(
                            f"trainer rank {self.rank}: update {step} aborted: {why}"
                        )
                if time.monotonic() > deadline:
                    stuck = sorted({peer for p, _ in in_flight for peer in p.ops})
                    raise TransportTimeoutError(
                        f"trainer rank {self.rank}: update {step} not complete after "
                        f"{timeout_s:.1f} s ({len(in_flight)} task(s) in flight"
                        + (f", waiting on peer(s) {stuck})" if stuck else ")")
                    )
                progressed = False
                if not finished_preparing:
                    try:
                        item = ready.get(timeout=0 if (in_flight or waiting) else 0.05)
                    except queue.Empty:
                        pass
                    else:
                        if item is None:
                            finished_preparing = True
                        elif isinstance(item, BaseException):
                            raise item
                        else:
                            waiting.append(item)
                            progressed = True
                # Post tasks whose device work is done, in order.
                while waiting and (waiting[0].event is None or waiting[0].event.query()):
                    p = waiting.pop(0)
                    p.record.write_start = time.perf_counter() - t0
                    posted: list[WriteHandle] = []
                    in_flight.append((p, posted))
                    for peer, ops in p.ops.items():
                        posted.append(self.transport.post_writes(peer, ops))
                    progressed = True
                # Batches mostly complete in posting order: poll from the oldest and stop at
                # the first unfinished one, so a long queue costs one poll per pass, not many.
                finished = 0
                for p, handles in in_flight:
                    try:
                        done = all([self.transport.poll(h) for h in handles])
                    except WeightTransferError as exc:
                        raise WeightTransferError(
                            f"trainer rank {self.rank}: writes of task {p.task.task_id} failed: {exc}"
                        ) from exc
                    if not done:
                        break
                    p.record.write_end = time.perf_counter() - t0
                    self._release(p)
                    records.append(p.record)
                    total += p.record.nbytes
                    finished += 1
                if finished:
                    del in_flight[:finished]
                    progressed = True
                if not progressed and (in_flight or waiting):
                    # Sleep on the oldest unfinished batch's completion event when its backend
                    # completes it on a thread (tcp, loopback host copies, ucx copy lanes), so
                    # this loop does not take a core from those threads; else back off
                    # briefly, except on progress-driven transports (ucx, nixl), whose data
                    # moves only while polled.
                    event = self._oldest_event(in_flight)
                    if event is not None:
                        event.wait(_EVENT_SLICE_S)
                    elif not self.transport.progress_driven:
                        time.sleep(2e-5)
        except BaseException as exc:
            abort.set()
            if on_failure is not None and not isinstance(exc, UpdateAbortedError):
                try:
                    on_failure(exc)
                except Exception as report_exc:  # the update fails anyway; say why it was quiet
                    log.warning("trainer rank %d: could not report the failure: %s", self.rank, report_exc)
            # Writes already posted may still read their staging memory: let them settle first.
            self._quiesce(in_flight, deadline)
            if worker.ident is None:
                worker.start()  # abort is set: it only enters this rank's collectives
            worker.join(timeout=max(0.1, deadline - time.monotonic()))
            if worker.is_alive():
                log.warning("trainer rank %d: preparation of update %d still running at its deadline", self.rank, step)
            for p in waiting:
                self._release(p)
            while True:  # prepared but never posted
                try:
                    item = ready.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Prepared):
                    self._release(item)
            raise
        worker.join(timeout=max(0.1, deadline - time.monotonic()))
        return UpdateStats(
            step=step,
            seconds=time.perf_counter() - t0,
            nbytes=total,
            num_tasks=len(records),
            peak_staging_bytes=self.arena.peak,
            peak_scratch_bytes=self._scratch_peak,
            records=tuple(sorted(records, key=lambda r: r.task_id)),
        )

    def _oldest_event(
        self, in_flight: list[tuple[_Prepared, list[WriteHandle]]]
    ) -> threading.Event | None:
        if not in_flight:
            return None
        for h in in_flight[0][1]:
            if not h.done:
                return self.transport.completion_event(h)
        return None

    def write_versions(self, step: int, timeout_s: float) -> None:
        """Write `step` into the version word of every engine this rank commits."""
        engines = self.schedule.version_engines
        if not engines:
            return
        self._version_buf.fill_(step)
        handles = []
        for i, e in enumerate(engines):
            vdesc = self.descriptors[e][self.version_regions[e]]
            handles.append(
                self.transport.post_writes(
                    e, [WriteOp(self._version_region, i * 8, vdesc, 0, 8)]
                )
            )
        for h in handles:
            self.transport.wait(h, timeout_s)

    # -- stages ----------------------------------------------------------------------------

    def _admit_and_prepare(
        self, task: Task, rec: TaskRecord, t0: float, deadline: float, abort: threading.Event
    ) -> _Prepared | None:
        # Admission: scratch within budget (a task alone may use it all), staging from the arena.
        while True:
            with self._lock:
                if self._scratch_in_use == 0 or self._scratch_in_use + task.scratch_bytes <= self.scratch_budget:
                    self._scratch_in_use += task.scratch_bytes
                    self._scratch_peak = max(self._scratch_peak, self._scratch_in_use)
                    break
            if abort.is_set():
                return None
            if time.monotonic() > deadline:
                raise TransportTimeoutError(f"trainer rank {self.rank}: task {task.task_id} never admitted")
            self.arena.wait_change(0.01)
        blocks: list[tuple[int, int]] = []
        try:
            if self._stream is not None:
                # Prepare on its own stream so packing, gathers and quantization overlap the
                # copy engines' writes; the write stage waits on this task's event.
                with torch.cuda.stream(self._stream):
                    return self._prepare(task, rec, t0, deadline, abort, blocks)
            return self._prepare(task, rec, t0, deadline, abort, blocks)
        except BaseException:
            for off, n in blocks:
                self.arena.free(off, n)
            with self._lock:
                self._scratch_in_use -= task.scratch_bytes
            raise

    def _static_ops(self, task: Task) -> dict[str, list[WriteOp]] | None:
        """The writes of a task that only sends straight from registered shards: the same
        every update, so built once (a prepared descriptor list)."""
        if task.gather or not task.writes:
            return None
        ops: dict[str, list[WriteOp]] = defaultdict(list)
        for w in task.writes:
            if not isinstance(w, SliceWrite) or not w.zero_copy:
                return None
            b = self.sources[w.source]
            if b.region is None or b.local_box is None:
                return None
            local = self._local(w.source)
            origin = [a for a, _ in b.local_box]
            src = local[_slices(w.source_box, origin)]
            self._ops_for_runs(w.engine, w.runs, b.region, src.data_ptr() - b.region.address, ops)
        return dict(ops)

    def _prepare(
        self, task: Task, rec: TaskRecord, t0: float, deadline: float, abort: threading.Event,
        blocks: list[tuple[int, int]],
    ) -> _Prepared:
        rec.admit = time.perf_counter() - t0
        fulls: dict[str, torch.Tensor | _Shifted] = {}
        rec.prepare_start = time.perf_counter() - t0
        if task.kind == "gather":
            for name in task.gather:
                fulls[name] = self._gather(task, name)
                self._gathers_done += 1
        elif task.gather:
            # A quantized unit whose source boxes lie inside this rank's own shards: no
            # collective. The shard starts at its local box, not at the tensor's origin.
            for name in task.gather:
                fulls[name] = self._local_as_global(name)
        ops: dict[str, list[WriteOp]] = defaultdict(list)
        for w in task.writes:
            if isinstance(w, SliceWrite):
                self._prepare_slice(task, w, fulls, ops, blocks, deadline, abort)
            else:
                self._prepare_quant(w, fulls, ops, blocks, deadline, abort)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record()
        rec.prepare_end = time.perf_counter() - t0
        del fulls
        return _Prepared(task, rec, dict(ops), blocks, task.scratch_bytes, event)

    def _gather(self, task: Task, name: str) -> torch.Tensor:
        """`full_tensor()` of a source (a collective over its mesh)."""
        try:
            return self.gather(self.sources[name].param)
        except Exception as exc:
            # gloo/NCCL name the lost peer only by address; say which collective.
            raise _CollectiveError(
                f"trainer rank {self.rank}: gathering {name!r} (task {task.task_id}, "
                f"mesh group {task.mesh_group}) failed; a trainer rank of its mesh is "
                f"lost or timed out: {type(exc).__name__}: {exc}"
            ) from exc

    def _quiesce(self, in_flight: list[tuple[_Prepared, list[WriteHandle]]], deadline: float) -> None:
        """After a failure: wait (at most `_QUIESCE_S`) for posted writes to finish or fail,
        then release their staging memory; what is still unsettled is quarantined, not freed,
        so no write can read memory that a later task was given."""
        until = time.monotonic() + _QUIESCE_S
        for p, handles in in_flight:
            for h in handles:
                while True:
                    try:
                        if self.transport.poll(h):
                            break
                    except WeightTransferError:
                        break  # failed: the transport no longer reads its memory
                    if time.monotonic() > until:
                        break
                    event = self.transport.completion_event(h)
                    if event is not None:
                        event.wait(0.01)
                    elif not self.transport.progress_driven:
                        time.sleep(1e-4)
            if all(_settled(h) for h in handles):
                self._release(p)
            else:
                self._quarantine.append((p, handles))
        in_flight.clear()

    def _settle_quarantine(self) -> None:
        """Release quarantined staging memory whose writes have settled since."""
        keep = []
        for p, handles in self._quarantine:
            for h in handles:
                try:
                    self.transport.poll(h)
                except WeightTransferError:
                    pass
            if all(_settled(h) for h in handles):
                self._release(p)
            else:
                keep.append((p, handles))
        if keep:
            log.warning(
                "trainer rank %d: %d task(s) of a failed update still have writes in flight; "
                "their staging memory stays reserved", self.rank, len(keep),
            )
        self._quarantine = keep

    def _capture_graphs(self) -> dict[int, tuple[Any, dict[str, list[WriteOp]], int, int, tuple[str, ...], int]]:
        todo = [t for t in self.schedule.tasks if t.task_id not in self._static]
        if not todo:
            raise _NotGraphable("no task needs preparation")
        per_task: list[tuple[Task, int, Any]] = []
        pos = 0
        for t in todo:
            if t.kind != "direct" or not t.gather or not all(isinstance(w, QuantWrite) for w in t.writes):
                raise _NotGraphable(f"task {t.task_id} is not a local quantization")
            for n in t.gather:
                local = self._local(n)
                if local.device != self.device:
                    raise _NotGraphable(f"source {n!r} is not on {self.device}")
            size = 0
            layout = []
            for w in t.writes:
                assert isinstance(w, QuantWrite)
                shape = box_shape(w.dest_box)
                aligned = _block_aligned_parts(w, shape, [a for a, _ in w.dest_box])
                if aligned is None:
                    raise _NotGraphable(f"task {t.task_id}: {w.dest} has parts inside one block")
                wb = -(-numel(shape) // _ALIGN) * _ALIGN
                sb = -(-numel(box_shape(w.scale_box)) * 4 // _ALIGN) * _ALIGN
                layout.append((w, aligned, size, size + wb))
                size += wb + sb
            if size > self.arena.nbytes:
                raise _NotGraphable(f"task {t.task_id} needs {size} bytes, more than the arena")
            per_task.append((t, size, layout))
        # Consecutive small tasks share one graph, one ring slice and one batch per engine, so
        # a MoE layer's hundreds of expert units cost a few replays and posts, not hundreds.
        group_limit = max(1, min(self.arena.nbytes // 8, 128 << 20))
        groups: list[list[tuple[Task, int, Any]]] = []
        for item in per_task:
            if groups and sum(x[1] for x in groups[-1]) + item[1] <= group_limit:
                groups[-1].append(item)
            else:
                groups.append([item])
        plans = []
        for members in groups:
            size = sum(x[1] for x in members)
            if pos + size > self.arena.nbytes:
                pos = 0
            plans.append((members, pos, size))
            pos += size
        graphs = {}
        for members, start, size in plans:
            calls = []
            ops: dict[str, list[WriteOp]] = defaultdict(list)
            flat = []
            base = start
            for _task, tsize, layout in members:
                flat += [(w, aligned, base - start + woff, base - start + soff) for w, aligned, woff, soff in layout]
                base += tsize
            for w, aligned, woff, soff in flat:
                shape = box_shape(w.dest_box)
                sshape = box_shape(w.scale_box)
                q = self.arena.view(start + woff, numel(shape)).view(torch.float8_e4m3fn).view(shape[-2], shape[-1])
                sc = self.arena.view(start + soff, numel(sshape) * 4).view(torch.float32).view(sshape[-2], sshape[-1])
                b0, b1 = w.block
                for p, (r0, r1, c0, c1) in aligned:
                    src = self._local_as_global(p.source)[_slices(p.source_box)].reshape(r1 - r0, c1 - c0)
                    calls.append((src, w.block, q[r0:r1, c0:c1], sc[r0 // b0:-(-r1 // b0), c0 // b1:-(-c1 // b1)]))
                self._ops_for_runs(w.engine, w.weight_runs, self.arena.region, start + woff, ops)
                self._ops_for_runs(w.engine, w.scale_runs, self.arena.region, start + soff, ops)
            assert self._stream is not None
            with torch.cuda.stream(self._stream):
                for src, block, q, sc in calls:  # compile and warm up outside the capture
                    self.quantize(src, block, q, sc)
            self._stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream):
                for src, block, q, sc in calls:
                    self.quantize(src, block, q, sc)
            first = members[0][0]
            names = tuple(sorted({n for t, _, _ in members for n in t.gather}))
            nbytes = sum(t.nbytes for t, _, _ in members)
            graphs[first.task_id] = (graph, dict(ops), start, start + size, names, nbytes)
            for t, _, _ in members[1:]:
                self._graph_skip.add(t.task_id)
        return graphs

    def _replay(
        self, task: Task, rec: TaskRecord, t0: float, deadline: float, abort: threading.Event
    ) -> _Prepared | None:
        graph, ops, start, end, names, nbytes = self._graphs[task.task_id]
        rec.nbytes = nbytes
        rec.admit = time.perf_counter() - t0
        with self._ring_cond:
            # Wait until no task in flight still owns bytes of this task's slice of the ring.
            while any(a < end and start < b for _, a, b in self._ring_busy):
                if abort.is_set():
                    return None
                if time.monotonic() > deadline:
                    raise TransportTimeoutError(
                        f"trainer rank {self.rank}: task {task.task_id} never got its staging slice"
                    )
                self._ring_cond.wait(0.01)
            self._ring_busy.append((task.task_id, start, end))
        for n in names:
            self._local(n)  # raises if a parameter was reallocated since the capture
        rec.prepare_start = time.perf_counter() - t0
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            graph.replay()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record(self._stream)
        rec.prepare_end = time.perf_counter() - t0
        return _Prepared(task, rec, ops, [], 0, event)

    def _release(self, p: _Prepared) -> None:
        if p.task.task_id in self._graphs:
            with self._ring_cond:
                self._ring_busy = [b for b in self._ring_busy if b[0] != p.task.task_id]
                self._ring_cond.notify_all()
            return
        for off, n in p.blocks:
            self.arena.free(off, n)
        p.blocks = []
        with self._lock:
            self._scratch_in_use -= p.scratch
        p.scratch = 0

    def _alloc(self, nbytes: int, blocks: list[tuple[int, int]], deadline: float, abort: threading.Event) -> int:
        while True:
            off = self.arena.try_alloc(nbytes)
            if off is not None:
                blocks.append((off, nbytes))
                return off
            if abort.is_set():
                raise WeightTransferError("update aborted")
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"trainer rank {self.rank}: no staging memory for {nbytes} bytes before the deadline"
                )
            self.arena.wait_change(0.01)

    def _local(self, name: str) -> torch.Tensor:
        b = self.sources[name]
        from weight_transfer.transfer.manifest import local_part

        local = local_part(b.param)
        if b.region is not None and local.untyped_storage().data_ptr() != b.storage_ptr:
            raise WeightTransferError(
                f"trainer rank {self.rank}: parameter {name!r} was reallocated since the sender "
                "registered it (its storage changed); update parameters in place, or build "
                "a new WeightSender after changing their storage"
            )
        return local

    def _local_as_global(self, name: str) -> _Shifted:
        """This rank's shard of `name`, indexed in the tensor's global coordinates."""
        b = self.sources[name]
        if b.local_box is None:
            raise WeightTransferError(
                f"trainer rank {self.rank}: task reads {name!r} from its own shard, but the "
                "shard is not a box (the plan and this rank's manifest disagree)"
            )
        return _Shifted(self._local(name), tuple(a for a, _ in b.local_box))

    def _ops_for_runs(
        self, engine: str, runs: Sequence[WriteRun], source: Region, base: int, ops: dict[str, list[WriteOp]]
    ) -> None:
        descs = self.descriptors[engine]
        off = base
        for r in runs:
            ops[engine].append(WriteOp(source, off, descs[r.region], r.offset_bytes, r.nbytes))
            off += r.nbytes

    def _prepare_slice(
        self,
        task: Task,
        w: SliceWrite,
        fulls: Mapping[str, torch.Tensor | _Shifted],
        ops: dict[str, list[WriteOp]],
        blocks: list[tuple[int, int]],
        deadline: float,
        abort: threading.Event,
    ) -> None:
        if w.source in fulls:
            src = fulls[w.source][_slices(w.source_box)]
        else:
            b = self.sources[w.source]
            local = self._local(w.source)
            assert b.local_box is not None
            origin = [a for a, _ in b.local_box]
            src = local[_slices(w.source_box, origin)]
            if w.zero_copy and b.region is not None:
                assert src.is_contiguous() or src.numel() == 1
                base = (src.data_ptr() - b.region.address)
                self._ops_for_runs(w.engine, w.runs, b.region, base, ops)
                return
        nbytes = w.nbytes
        off = self._alloc(nbytes, blocks, deadline, abort)
        dst = self.arena.view(off, nbytes).view(torch_dtype(w.dtype)).view(box_shape(w.source_box))
        dst.copy_(src, non_blocking=True)
        self._ops_for_runs(w.engine, w.runs, self.arena.region, off, ops)

    def _prepare_quant(
        self,
        w: QuantWrite,
        fulls: Mapping[str, torch.Tensor | _Shifted],
        ops: dict[str, list[WriteOp]],
        blocks: list[tuple[int, int]],
        deadline: float,
        abort: threading.Event,
    ) -> None:
        shape = box_shape(w.dest_box)
        origin = [a for a, _ in w.dest_box]
        wbytes = numel(shape)
        sshape = box_shape(w.scale_box)
        sbytes = numel(sshape) * 4
        woff = self._alloc(wbytes, blocks, deadline, abort)
        soff = self._alloc(sbytes, blocks, deadline, abort)
        q = self.arena.view(woff, wbytes).view(torch.float8_e4m3fn).view(shape)
        s = self.arena.view(soff, sbytes).view(torch.float32).view(sshape)
        aligned = _block_aligned_parts(w, shape, origin)
        if aligned is not None:
            # Every part covers whole quantization blocks: quantize each straight from its
            # source into its rows of the destination, with no high-precision assembly.
            q2 = q.view(shape[-2], shape[-1])
            s2 = s.view(sshape[-2], sshape[-1])
            b0, b1 = w.block
            for p, (r0, r1, c0, c1) in aligned:
                src = fulls[p.source][_slices(p.source_box)].reshape(r1 - r0, c1 - c0)
                if src.device != q2.device:
                    src = src.to(q2.device, non_blocking=True)
                self.quantize(
                    src, w.block, q2[r0:r1, c0:c1],
                    s2[r0 // b0:-(-r1 // b0), c0 // b1:-(-c1 // b1)],
                )
        else:
            dev = next(iter(fulls.values())).device if fulls else self.device
            hp = torch.empty(shape, dtype=torch.float32, device=dev)
            for p in w.parts:
                part = fulls[p.source][_slices(p.source_box)]
                hp[_slices(p.dest_box, origin)].copy_(part.reshape(box_shape(p.dest_box)))
            if hp.device != self.arena.buffer.device:
                hp = hp.to(self.arena.buffer.device)
            self.quantize(hp, w.block, q, s)
        self._ops_for_runs(w.engine, w.weight_runs, self.arena.region, woff, ops)
        self._ops_for_runs(w.engine, w.scale_runs, self.arena.region, soff, ops)

    def close(self) -> None:
        """Release registrations made by the executor."""
        for r in (self.arena.region, self._version_region):
            try:
                self.transport.deregister(r)
            except (ValueError, WeightTransferError):
                pass


def _settled(h: WriteHandle) -> bool:
    """The batch completed or failed: the transport reads none of its memory any more."""
    return h.done or h.error is not None


class _Shifted:
    """A local shard that slices like the global tensor: `[box]` takes global coordinates."""

    __slots__ = ("device", "origin", "tensor")

    def __init__(self, tensor: torch.Tensor, origin: tuple[int, ...]) -> None:
        self.tensor = tensor
        self.origin = origin
        self.device = tensor.device

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        shifted = tuple(
            slice(s.start - o, s.stop - o) for s, o in zip(index, self.origin, strict=True)
        )
        for s, n in zip(shifted, self.tensor.shape, strict=True):
            assert 0 <= s.start <= s.stop <= n, "a local task's box lies outside this rank's shard"
        return self.tensor[shifted]


def _block_aligned_parts(
    w: QuantWrite, shape: tuple[int, ...], origin: Sequence[int]
) -> list[tuple[Any, tuple[int, int, int, int]]] | None:
    """Each part's (row0, row1, col0, col1) inside the unit if every part starts on a block
    boundary and ends on one or at the unit's edge (so no block mixes parts); else None."""
    if any(n != 1 for n in shape[:-2]):
        return None
    rows, cols = shape[-2], shape[-1]
    b0, b1 = w.block
    out = []
    for p in w.parts:
        (r0, r1), (c0, c1) = [(a - o, b - o) for (a, b), o in zip(p.dest_box[-2:], origin[-2:], strict=True)]
        if r0 % b0 or c0 % b1 or (r1 % b0 and r1 != rows) or (c1 % b1 and c1 != cols):
            return None
        if numel(box_shape(p.source_box)) != (r1 - r0) * (c1 - c0):
            return None
        out.append((p, (r0, r1, c0, c1)))
    return out


def trace_events(records: Sequence[TaskRecord], *, rank: int, step: int) -> list[dict[str, Any]]:
    """Chrome/Perfetto trace events ("X" complete events, microseconds) for one update."""
    events: list[dict[str, Any]] = []
    for r in records:
        for stage, a, b in (("prepare", r.prepare_start, r.prepare_end), ("write", r.write_start, r.write_end)):
            if b > a:
                events.append(
                    {
                        "name": f"task {r.task_id} ({r.kind})",
                        "cat": stage,
                        "ph": "X",
                        "ts": a * 1e6,
                        "dur": (b - a) * 1e6,
                        "pid": rank,
                        "tid": stage,
                        "args": {"bytes": r.nbytes, "step": step},
                    }
                )
    return events
