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

An update is ordered after the caller's current CUDA stream (an event recorded there at the
start: the prepare stream waits on it, and zero-copy posts wait for it), so `update()` right
after an optimizer step needs no synchronize. Writes that repeat every update are handed to the
transport once as prepared batches (`Transport.prepare_writes`), so posting them costs no
per-write work (loopback: one copy-kernel launch over a device table); FP8 graph groups quantize
straight into the engine's memory where the transport maps it on this GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backends.base import (
    PreparedWrites,
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
from weight_transfer.manifest import local_part, torch_dtype
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

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

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
        return self.buffer[offset : offset + nbytes]


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
class _StaticTask:
    """A task that sends straight from registered shards: the same writes every update."""

    sources: tuple[str, ...]
    """Parameters it reads (checked for reallocation before each update)."""
    ops: dict[str, list[WriteOp]]


@dataclasses.dataclass(slots=True)
class _StaticBatch:
    """Consecutive static tasks' writes to one engine, posted as one prepared batch."""

    peer: str
    task_ids: tuple[int, ...]
    ops: list[WriteOp]
    sources: list[str] = dataclasses.field(default_factory=list)
    """Parameters its writes read (checked right before it is posted)."""
    prepared: PreparedWrites | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _QuantCall:
    """One quantize call captured in a group's CUDA graph."""

    src: torch.Tensor
    block: tuple[int, int]
    q: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass(slots=True)
class _GraphGroup:
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
    direct: tuple[torch.Tensor, ...] = ()
    """Engine memory its graph writes straight into (kept mapped while the graph lives)."""
    fast_check: _PointerCheck | None = None
    """Its sources' addresses at capture (see `_PointerCheck`)."""


@dataclasses.dataclass(slots=True)
class _InFlight:
    """Posted batches of one prepared task (or of a group of static tasks)."""

    prepared: _Prepared
    handles: list[WriteHandle]
    records: list[TaskRecord]
    """Every task record these batches complete."""


@dataclasses.dataclass(slots=True)
class _RunState:
    """What one update's write loop tracks."""

    step: int
    t0: float
    deadline: float
    timeout_s: float
    ready: queue.Queue[_Prepared | BaseException | None]
    abort: threading.Event
    records: list[TaskRecord] = dataclasses.field(default_factory=list)
    in_flight: list[_InFlight] = dataclasses.field(default_factory=list)
    waiting: list[_Prepared] = dataclasses.field(default_factory=list)
    finished_preparing: bool = False
    total: int = 0
    num_writes: int = 0
    post_seconds: float = 0.0
    """Host time spent in the transport's post calls."""
    cancelled: Callable[[], str | None] | None = None
    """Polled about every `_CANCEL_POLL_S`: a message once another rank failed."""
    next_poll: float = 0.0


_GROUP_BYTES = 1 << 30
"""Output bytes of one captured graph group, at most (unless one task is larger)."""
_GROUP_CALLS = 4096
"""Quantize kernels in one captured graph group, at most (unless one task has more)."""

_TABLE_QUANT = os.environ.get("WT_TABLE_QUANT", "1") != "0"
"""Graph groups quantize through one `QuantTable` launch per block shape and dtype (default);
WT_TABLE_QUANT=0 captures one kernel per call instead (the benchmarks' comparison)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _TableLaunch:
    """One launch over a `QuantTable` (kept alive by the graph group that captured it)."""

    table: Any

    def __call__(self) -> None:
        self.table.launch()


_STATIC_BATCH_BYTES = 1 << 30
"""Static tasks' writes to one engine are posted in prepared batches of about this size."""


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
    num_writes: int = 0
    """Write ops posted (before any coalescing by the transport)."""
    post_seconds: float = 0.0
    """Host time the write stage spent posting (the prepare stage's host time is in records)."""
    phases: tuple[tuple[str, float], ...] = ()
    """Seconds of the steps `WeightSender.update` takes around the executor, in order: "go",
    "done" (every rank's report and the commit verdict), "versions" (writing the version
    words), "result" (the committed reports and the result engines confirm from)."""


GatherFn = Callable[[torch.Tensor], torch.Tensor]
BarrierFn = Callable[[int], None]
QuantFn = Callable[[torch.Tensor, tuple[int, int], torch.Tensor, torch.Tensor], None]


def _slices(box: Box, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin, strict=True))


def default_quantize(
    x: torch.Tensor, block: tuple[int, int], out_q: torch.Tensor, out_s: torch.Tensor
) -> None:
    """Quantize into `out_q`/`out_s` with the GPU kernel on CUDA, else the reference."""
    if x.is_cuda:
        from weight_transfer.kernels.fp8_triton import quantize_fp8

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
        direct_writes: bool = True,
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
        self._task_by_id = {t.task_id: t for t in schedule.tasks}
        self._direct = direct_writes
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
        self._lock = threading.Lock()
        self._gathers_done = 0  # of the task being prepared (what a drain still owes)
        self._quarantine: list[_InFlight] = []
        """Batches of failed updates that had not settled: their staging stays reserved."""
        # torch.cuda.Stream/Event constructors are unannotated in torch's stubs.
        self._stream = (
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )
        self._static: dict[int, _StaticTask] = {}
        for t in schedule.tasks:
            ops = self._static_ops(t)
            if ops is not None:
                names = tuple(sorted({w.source for w in t.writes if isinstance(w, SliceWrite)}))
                self._static[t.task_id] = _StaticTask(names, ops)
        self._static_batches = _static_batches(schedule.tasks, self._static)
        self._seen_local: dict[str, tuple[torch.Tensor, int]] = {}
        self._fast_check: _PointerCheck | None = None
        """The static batches' sources (`_static_names`) as last checked one by one."""
        self._static_names = sorted({n for st in self._static.values() for n in st.sources})
        # Ring mode (CUDA): when every other task only quantizes block-aligned parts of sources
        # this rank holds, each task gets a fixed slice of the arena (a ring: tasks are admitted
        # and released in order) and its kernels are captured once as a CUDA graph, so an
        # update replays one graph per task instead of re-issuing every launch from Python.
        self._graphs: dict[int, _GraphGroup] = {}
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
                log.warning(
                    "trainer rank %d: CUDA graph capture failed, running eagerly: %s", rank, exc
                )
                self._graphs = {}
                self._graph_skip = set()
                torch.cuda.synchronize(device)
        self._prepare_stage = schedule.num_mesh_groups > 1 or any(
            t.task_id not in self._static and t.task_id not in self._graph_skip
            for t in schedule.tasks
        )
        """Whether an update needs the prepare thread (not when every task is a static batch)."""

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

        Everything it reads is ordered after the work queued so far on the caller's current
        CUDA stream (the optimizer's last step, with no synchronize needed): the prepare stream
        waits on that stream, and writes straight from the parameters are posted only once an
        event recorded on it at the start has completed.

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
        st = _RunState(
            step=step,
            t0=time.perf_counter(),
            deadline=time.monotonic() + timeout_s,
            timeout_s=timeout_s,
            ready=queue.Queue(),
            abort=threading.Event(),
            cancelled=cancelled,
        )
        self._settle_quarantine()
        caller_done = self._order_after_caller()
        self.arena.peak = self.arena.in_use
        self._scratch_peak = self._scratch_in_use
        # When every task is a static batch (and there are no mesh-group barriers to enter),
        # there is nothing to prepare: no prepare thread, whose start costs more than posting.
        worker: threading.Thread | None = None
        if self._prepare_stage:
            worker = threading.Thread(
                target=self._prepare_loop,
                args=(st,),
                name=f"wt-prepare-r{self.rank}",
                daemon=True,
            )
            # Preparation starts at once; a failure while posting the static batches sets
            # `abort`, and the prepare stage then only enters its collectives.
            worker.start()
        else:
            st.finished_preparing = True
        try:
            self._post_static(st, caller_done)
            while not st.finished_preparing or st.waiting or st.in_flight:
                self._check_cancelled(st)
                self._check_deadline(st)
                progressed = self._take_ready(st)
                progressed |= self._post_waiting(st)
                progressed |= self._reap(st)
                if not progressed and (st.in_flight or st.waiting):
                    self._idle(st)
        except BaseException as exc:
            self._fail(st, worker, exc, on_failure)
            raise
        if worker is not None:
            worker.join(timeout=max(0.1, st.deadline - time.monotonic()))
        return UpdateStats(
            step=step,
            seconds=time.perf_counter() - st.t0,
            nbytes=st.total,
            num_tasks=len(st.records),
            peak_staging_bytes=self.arena.peak,
            peak_scratch_bytes=self._scratch_peak,
            records=tuple(sorted(st.records, key=lambda r: r.task_id)),
            num_writes=st.num_writes,
            post_seconds=st.post_seconds,
        )

    def _fail(
        self,
        st: _RunState,
        worker: threading.Thread | None,
        exc: BaseException,
        on_failure: Callable[[BaseException], None] | None,
    ) -> None:
        """After a failure: report it, let posted writes settle, keep the collectives going
        (the prepare stage drains), and release what no write can read any more."""
        st.abort.set()
        if on_failure is not None and not isinstance(exc, UpdateAbortedError):
            try:
                on_failure(exc)
            except Exception as report_exc:  # the update fails anyway; say why it was quiet
                log.warning(
                    "trainer rank %d: could not report the failure: %s", self.rank, report_exc
                )
        # Writes already posted may still read their staging memory: let them settle first.
        self._quiesce(st.in_flight)
        if worker is None:  # nothing to prepare: no collectives, nothing in the ready queue
            return
        if worker.ident is None:
            worker.start()  # abort is set: it only enters this rank's collectives
        worker.join(timeout=max(0.1, st.deadline - time.monotonic()))
        if worker.is_alive():
            log.warning(
                "trainer rank %d: preparation of update %d still running at its deadline",
                self.rank,
                st.step,
            )
        for p in st.waiting:
            self._release(p)
        while True:  # prepared but never posted
            try:
                item = st.ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Prepared):
                self._release(item)

    def _check_cancelled(self, st: _RunState) -> None:
        """Raise once another rank reported a failure of this update."""
        if st.cancelled is None or time.monotonic() < st.next_poll:
            return
        st.next_poll = time.monotonic() + _CANCEL_POLL_S
        why = st.cancelled()
        if why:
            raise UpdateAbortedError(f"trainer rank {self.rank}: update {st.step} aborted: {why}")

    def _order_after_caller(self) -> Any:
        """Order this update after the caller's current stream: the prepare stream waits on it
        on the device; the returned event (None off CUDA) gates the zero-copy posts."""
        if self._stream is None:
            return None
        caller = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(caller)
        # Preparation reads parameters the caller's stream (the optimizer) last wrote.
        self._stream.wait_event(event)
        return event

    def _wait_caller(self, st: _RunState, event: Any) -> None:
        """Host-wait (bounded by the deadline) for the caller's work queued before `run`."""
        while not event.query():
            if time.monotonic() > st.deadline:
                raise TransportTimeoutError(
                    f"trainer rank {self.rank}: update {st.step}: the work queued on the "
                    f"caller's CUDA stream did not finish within {st.timeout_s:.1f} s"
                )
            time.sleep(2e-5)

    def _prepare_loop(self, st: _RunState) -> None:
        """The prepare stage (its own thread): tasks in order, handed to the write stage.

        After a failure (its own, or `abort` set by the write stage) it prepares nothing more
        but still enters the collectives left in the schedule (`_drain`), so the other ranks of
        its meshes do not wait in them until they time out.
        """
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
                if failed or st.abort.is_set():
                    self._drain(task, 0)
                    continue
                rec = TaskRecord(task.task_id, task.kind, task.nbytes)
                self._gathers_done = 0
                try:
                    if task.task_id in self._graphs:
                        prepared = self._replay(task, rec, st.t0, st.deadline, st.abort)
                    else:
                        prepared = self._admit_and_prepare(task, rec, st.t0, st.deadline, st.abort)
                except _CollectiveError:
                    raise
                except BaseException as exc:  # the write stage raises it; keep draining
                    st.ready.put(exc)
                    failed = True
                    self._drain(task, self._gathers_done)
                    continue
                if prepared is None:  # aborted while waiting for memory
                    self._drain(task, self._gathers_done)
                    continue
                st.ready.put(prepared)
                # Let the write stage take the GIL now rather than at the next switch
                # interval (5 ms), so writes start as soon as their task is ready.
                time.sleep(0)
            while group < self.schedule.num_mesh_groups - 1:
                group += 1
                self.barrier(group)
            st.ready.put(None)
        except BaseException as exc:  # a broken collective: handed to the write stage
            st.ready.put(exc)

    def _drain(self, task: Task, gathers_done: int) -> None:
        """Enter the collectives of `task` that have not run yet; prepare nothing."""
        if task.kind == "gather":
            for name in task.gather[gathers_done:]:
                self._gather(task, name)

    def _post_static(self, st: _RunState, caller_done: Any) -> None:
        """Tasks that send straight from registered shards need no preparation: check once
        that no parameter moved, then post their prepared batches before anything else."""
        if not self._static_batches:
            return
        if caller_done is not None:
            self._wait_caller(st, caller_done)
        now = time.perf_counter() - st.t0
        first_update = not self._seen_local
        if first_update:
            self._check_unmoved(self._static_names)
        for batch in self._static_batches:
            if batch.prepared is None:
                batch.prepared = self.transport.prepare_writes(batch.peer, batch.ops)
            recs = []
            for tid in batch.task_ids:
                task = self._task_by_id[tid]
                recs.append(TaskRecord(tid, task.kind, task.nbytes, now, now, now, now))
            first = (
                self._task_by_id[batch.task_ids[0]] if batch.task_ids else self.schedule.tasks[0]
            )
            rec = recs[0] if recs else TaskRecord(first.task_id, first.kind, 0)
            p = _Prepared(first, rec, {batch.peer: batch.ops}, [], 0, None)
            # In flight before posting: a failed post leaves the batches posted before it to be
            # waited for.
            handles: list[WriteHandle] = []
            st.in_flight.append(_InFlight(p, handles, recs))
            t_post = time.perf_counter()
            handles.append(self.transport.post_prepared(batch.prepared))
            st.post_seconds += time.perf_counter() - t_post
            st.num_writes += len(batch.ops)
        if not first_update:
            # After the first update the check runs while the copies run: a parameter that
            # moved since then is still registered (its Region keeps the old memory alive),
            # so reading it is safe, and raising here fails the update before any commit.
            self._check_unmoved(self._static_names)

    def _check_unmoved(self, names: Sequence[str]) -> None:
        """Raise if a parameter was reallocated since registration (`_local`), cheaply.

        After the first update the addresses of all the parameters are read with C-level
        `map`s and compared with the ones first seen as one list (a MoE model has ~19k
        parameters: a Python loop over them took longer than the copies). A parameter's
        registered storage stays alive, so an unchanged address is unchanged memory. Only when
        the lists differ is each parameter checked (and the offender named)."""
        if self._fast_check is not None and self._fast_check.moved() is None:
            return
        seen = self._seen_local
        for n in names:
            local = local_part(self.sources[n].param)
            first = seen.get(n)
            if first is not None and first[0] is local and first[1] == local.data_ptr():
                continue
            local = self._local(n)
            seen[n] = (local, local.data_ptr())
        self._fast_check = _PointerCheck.of([self.sources[n].param for n in names])

    def _check_deadline(self, st: _RunState) -> None:
        if time.monotonic() > st.deadline:
            stuck = sorted({peer for f in st.in_flight for peer in f.prepared.ops})
            raise TransportTimeoutError(
                f"trainer rank {self.rank}: update {st.step} not complete after "
                f"{st.timeout_s:.1f} s ({len(st.in_flight)} task(s) in flight"
                + (f", waiting on peer(s) {stuck})" if stuck else ")")
            )

    def _take_ready(self, st: _RunState) -> bool:
        """Move one prepared task from the prepare stage into `waiting` (True if one came)."""
        if st.finished_preparing:
            return False
        try:
            item = st.ready.get(timeout=0 if (st.in_flight or st.waiting) else 0.05)
        except queue.Empty:
            return False
        if item is None:
            st.finished_preparing = True
            return False
        if isinstance(item, BaseException):
            raise item
        st.waiting.append(item)
        return True

    def _post_waiting(self, st: _RunState) -> bool:
        """Post tasks whose device work is done, in order."""
        posted = False
        while st.waiting and (st.waiting[0].event is None or st.waiting[0].event.query()):
            p = st.waiting.pop(0)
            t_post = time.perf_counter()
            p.record.write_start = t_post - st.t0
            group = self._graphs.get(p.task.task_id)
            # In flight before posting, as in `_post_static`.
            handles: list[WriteHandle] = []
            st.in_flight.append(_InFlight(p, handles, [p.record]))
            if group is not None:
                for peer, ops in p.ops.items():
                    prepared = group.prepared.get(peer)
                    if prepared is None:
                        prepared = group.prepared[peer] = self.transport.prepare_writes(peer, ops)
                    handles.append(self.transport.post_prepared(prepared))
            else:
                for peer, ops in p.ops.items():
                    handles.append(self.transport.post_writes(peer, ops))
            st.post_seconds += time.perf_counter() - t_post
            st.num_writes += sum(len(ops) for ops in p.ops.values())
            posted = True
        return posted

    def _reap(self, st: _RunState) -> bool:
        """Finish completed batches. They mostly complete in posting order: poll from the
        oldest and stop at the first unfinished one, so a long queue costs one poll a pass."""
        finished = 0
        for f in st.in_flight:
            try:
                done = all([self.transport.poll(h) for h in f.handles])
            except WeightTransferError as exc:
                raise WeightTransferError(
                    f"trainer rank {self.rank}: writes of task {f.prepared.task.task_id} "
                    f"failed: {exc}"
                ) from exc
            if not done:
                break
            end = time.perf_counter() - st.t0
            self._release(f.prepared)
            for rec in f.records:
                rec.write_end = end
                st.records.append(rec)
                st.total += rec.nbytes
            finished += 1
        if finished:
            del st.in_flight[:finished]
        return finished > 0

    def _idle(self, st: _RunState) -> None:
        """Nothing moved this pass. Sleep on the oldest unfinished batch's completion event
        when its backend completes it on a thread (tcp, loopback host copies, ucx copy
        lanes), so this loop does not take a core from those threads; else back off briefly,
        except on progress-driven transports (ucx, nixl), whose data moves only while polled."""
        event = self._oldest_event(st.in_flight)
        if event is not None:
            event.wait(_EVENT_SLICE_S)
        elif not self.transport.progress_driven:
            time.sleep(2e-5)

    def _oldest_event(self, in_flight: list[_InFlight]) -> threading.Event | None:
        if not in_flight:
            return None
        for h in in_flight[0].handles:
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
                self.transport.post_writes(e, [WriteOp(self._version_region, i * 8, vdesc, 0, 8)])
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
                if (
                    self._scratch_in_use == 0
                    or self._scratch_in_use + task.scratch_bytes <= self.scratch_budget
                ):
                    self._scratch_in_use += task.scratch_bytes
                    self._scratch_peak = max(self._scratch_peak, self._scratch_in_use)
                    break
            if abort.is_set():
                return None
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"trainer rank {self.rank}: task {task.task_id} never admitted"
                )
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
        self,
        task: Task,
        rec: TaskRecord,
        t0: float,
        deadline: float,
        abort: threading.Event,
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

    def _capture_graphs(self) -> dict[int, _GraphGroup]:
        todo = [t for t in self.schedule.tasks if t.task_id not in self._static]
        if not todo:
            raise _NotGraphable("no task needs preparation")
        per_task: list[tuple[Task, int, Any]] = []
        work_of: dict[int, tuple[int, int]] = {}
        pos = 0
        for t in todo:
            if (
                t.kind != "direct"
                or not t.gather
                or not all(isinstance(w, QuantWrite) for w in t.writes)
            ):
                raise _NotGraphable(f"task {t.task_id} is not a local quantization")
            for n in t.gather:
                local = self._local(n)
                if local.device != self.device:
                    raise _NotGraphable(f"source {n!r} is not on {self.device}")
            size = work = ncalls = 0
            layout = []
            for w in t.writes:
                assert isinstance(w, QuantWrite)
                shape = box_shape(w.dest_box)
                aligned = _block_aligned_parts(w, shape, [a for a, _ in w.dest_box])
                if aligned is None:
                    raise _NotGraphable(f"task {t.task_id}: {w.dest} has parts inside one block")
                wb = -(-numel(shape) // _ALIGN) * _ALIGN
                sb = -(-numel(box_shape(w.scale_box)) * 4 // _ALIGN) * _ALIGN
                direct = self._direct_views(w) if self._direct else None
                layout.append((w, aligned, size, size + wb, direct))
                if direct is None:  # written straight into the engine: no staging needed
                    size += wb + sb
                work += wb
                ncalls += len(aligned)
            if size > self.arena.nbytes:
                raise _NotGraphable(f"task {t.task_id} needs {size} bytes, more than the arena")
            per_task.append((t, size, layout))
            work_of[t.task_id] = (work, ncalls)
        # Consecutive small tasks share one graph, one ring slice and one batch per engine, so
        # a MoE layer's hundreds of expert units cost a few replays and posts, not hundreds.
        # Direct units take no ring space; a group also closes at _GROUP_BYTES of output or
        # _GROUP_CALLS kernels, so the write stage still sees progress and graphs stay small.
        group_limit = max(1, min(self.arena.nbytes // 8, 128 << 20))
        groups: list[list[tuple[Task, int, Any]]] = []
        totals = [0, 0, 0]  # staged bytes, output bytes, calls of the open group
        for item in per_task:
            work, ncalls = work_of[item[0].task_id]
            if groups and (
                totals[0] + item[1] <= group_limit
                and totals[1] + work <= _GROUP_BYTES
                and totals[2] + ncalls <= _GROUP_CALLS
            ):
                groups[-1].append(item)
                totals = [totals[0] + item[1], totals[1] + work, totals[2] + ncalls]
            else:
                groups.append([item])
                totals = [item[1], work, ncalls]
        plans = []
        for members in groups:
            size = sum(x[1] for x in members)
            if pos + size > self.arena.nbytes:
                pos = 0
            plans.append((members, pos, size))
            pos += size
        graphs = {}
        for members, start, size in plans:
            calls: list[_QuantCall] = []
            keep: list[torch.Tensor] = []
            ops: dict[str, list[WriteOp]] = defaultdict(list)
            flat = []
            base = start
            for _task, tsize, layout in members:
                flat += [
                    (w, aligned, base - start + woff, base - start + soff, direct)
                    for w, aligned, woff, soff, direct in layout
                ]
                base += tsize
            for w, aligned, woff, soff, direct in flat:
                shape = box_shape(w.dest_box)
                sshape = box_shape(w.scale_box)
                if direct is not None:
                    q, sc = direct  # quantize straight into the engine's memory: no staging
                else:
                    q = (
                        self.arena.view(start + woff, numel(shape))
                        .view(torch.float8_e4m3fn)
                        .view(shape[-2], shape[-1])
                    )
                    sc = (
                        self.arena.view(start + soff, numel(sshape) * 4)
                        .view(torch.float32)
                        .view(sshape[-2], sshape[-1])
                    )
                b0, b1 = w.block
                for p, (r0, r1, c0, c1) in aligned:
                    src = self._local_as_global(p.source)[_slices(p.source_box)].reshape(
                        r1 - r0, c1 - c0
                    )
                    calls.append(
                        _QuantCall(
                            src,
                            w.block,
                            q[r0:r1, c0:c1],
                            sc[r0 // b0 : -(-r1 // b0), c0 // b1 : -(-c1 // b1)],
                        )
                    )
                if direct is not None:
                    keep += [q, sc]
                    continue
                self._ops_for_runs(w.engine, w.weight_runs, self.arena.region, start + woff, ops)
                self._ops_for_runs(w.engine, w.scale_runs, self.arena.region, start + soff, ops)
            assert self._stream is not None
            launches = self._group_launches(calls)
            with torch.cuda.stream(self._stream):
                for launch in launches:  # compile and warm up outside the capture
                    launch()
            self._stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream):
                for launch in launches:
                    launch()
            keep += [
                t
                for launch in launches
                if isinstance(launch, _TableLaunch)
                for t in (launch.table.units, launch.table.block_unit)
            ]
            first = members[0][0]
            names = tuple(sorted({n for t, _, _ in members for n in t.gather}))
            nbytes = sum(t.nbytes for t, _, _ in members)
            graphs[first.task_id] = _GraphGroup(
                graph,
                dict(ops),
                start,
                start + size,
                names,
                nbytes,
                direct=tuple(keep),
                fast_check=_PointerCheck.of([self.sources[n].param for n in names]),
            )
            for t, _, _ in members[1:]:
                self._graph_skip.add(t.task_id)
        return graphs

    def _group_launches(self, calls: Sequence[_QuantCall]) -> list[Callable[[], None]]:
        """The launches that quantize a graph group's calls. With the default quantizer, calls
        of one block shape and input dtype that the table kernel takes become one launch over a
        `QuantTable` (a MoE layer's experts: one launch, not hundreds of small ones); the rest
        (and any custom `quantize`) are one call each."""
        if self.quantize is not default_quantize or not _TABLE_QUANT:
            return [functools.partial(self.quantize, c.src, c.block, c.q, c.scale) for c in calls]
        from weight_transfer.kernels.fp8_triton import QuantTable

        tables: dict[tuple[tuple[int, int], torch.dtype], list[_QuantCall]] = {}
        launches: list[Callable[[], None]] = []
        for c in calls:
            if QuantTable.why_not(c.src, c.q, c.scale, c.block) is None:
                tables.setdefault((c.block, c.src.dtype), []).append(c)
            else:
                launches.append(functools.partial(self.quantize, c.src, c.block, c.q, c.scale))
        for (block, _dtype), members in tables.items():
            table = QuantTable([(c.src, c.q, c.scale) for c in members], block)
            launches.append(_TableLaunch(table))
        return launches

    def _direct_views(self, w: QuantWrite) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The unit's weight and scale as views of the engine's own memory, where the transport
        maps it on this GPU and each is one contiguous run; else None (staged and written)."""
        if len(w.weight_runs) != 1 or len(w.scale_runs) != 1:
            return None
        shape, sshape = box_shape(w.dest_box), box_shape(w.scale_box)
        wr, sr = w.weight_runs[0], w.scale_runs[0]
        if wr.nbytes != numel(shape) or sr.nbytes != numel(sshape) * 4:
            return None
        descs = self.descriptors[w.engine]
        try:
            qv = self.transport.direct_view(
                w.engine, descs[wr.region], wr.offset_bytes, wr.nbytes, self.device
            )
            sv = self.transport.direct_view(
                w.engine, descs[sr.region], sr.offset_bytes, sr.nbytes, self.device
            )
        except (ValueError, WeightTransferError) as exc:  # e.g. not connected yet: stage it
            log.info("trainer rank %d: %s staged, no direct view: %s", self.rank, w.dest, exc)
            return None
        if qv is None or sv is None:
            return None
        try:
            q = qv.view(torch.float8_e4m3fn).view(shape[-2], shape[-1])
            s = sv.view(torch.float32).view(sshape[-2], sshape[-1])
        except RuntimeError:  # a view the dtype cannot take (alignment): stage it instead
            return None
        return q, s

    def _replay(
        self, task: Task, rec: TaskRecord, t0: float, deadline: float, abort: threading.Event
    ) -> _Prepared | None:
        group = self._graphs[task.task_id]
        start, end = group.start, group.end
        rec.nbytes = group.nbytes
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
        # The graph reads the addresses its parameters had at capture: fail if one moved. A
        # MoE layer's group reads hundreds of expert parameters, compared as one list.
        fast = group.fast_check
        moved = fast.moved() if fast is not None else None
        if moved is not None:
            raise WeightTransferError(
                f"trainer rank {self.rank}: parameter {group.sources[moved]!r} was reallocated "
                "since the sender captured its quantization (its address changed); update "
                "parameters in place, or build a new WeightSender after changing their storage"
            )
        if fast is None:  # a mix of DTensors and plain tensors: one by one
            for n in group.sources:
                self._local(n)
        rec.prepare_start = time.perf_counter() - t0
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            group.graph.replay()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record(self._stream)
        rec.prepare_end = time.perf_counter() - t0
        return _Prepared(task, rec, group.ops, [], 0, event)

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

    def _alloc(
        self, nbytes: int, blocks: list[tuple[int, int]], deadline: float, abort: threading.Event
    ) -> int:
        while True:
            off = self.arena.try_alloc(nbytes)
            if off is not None:
                blocks.append((off, nbytes))
                return off
            if abort.is_set():
                raise WeightTransferError("update aborted")
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"trainer rank {self.rank}: no staging memory for {nbytes} bytes before the "
                    "deadline"
                )
            self.arena.wait_change(0.01)

    def _local(self, name: str) -> torch.Tensor:
        b = self.sources[name]
        from weight_transfer.manifest import local_part

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

    def _quiesce(self, in_flight: list[_InFlight]) -> None:
        """After a failure: wait (at most `_QUIESCE_S`) for posted writes to finish or fail,
        then release their staging memory; what is still unsettled is quarantined, not freed,
        so no write can read memory that a later task was given."""
        until = time.monotonic() + _QUIESCE_S
        for f in in_flight:
            for h in f.handles:
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
            if all(_settled(h) for h in f.handles):
                self._release(f.prepared)
            else:
                self._quarantine.append(f)
        in_flight.clear()

    def _settle_quarantine(self) -> None:
        """Release quarantined staging memory whose writes have settled since."""
        keep = []
        for f in self._quarantine:
            for h in f.handles:
                try:
                    self.transport.poll(h)
                except WeightTransferError:
                    pass
            if all(_settled(h) for h in f.handles):
                self._release(f.prepared)
            else:
                keep.append(f)
        if keep:
            log.warning(
                "trainer rank %d: %d task(s) of a failed update still have writes in flight; "
                "their staging memory stays reserved",
                self.rank,
                len(keep),
            )
        self._quarantine = keep

    def _ops_for_runs(
        self,
        engine: str,
        runs: Sequence[WriteRun],
        source: Region,
        base: int,
        ops: dict[str, list[WriteOp]],
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
                base = src.data_ptr() - b.region.address
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
                    src,
                    w.block,
                    q2[r0:r1, c0:c1],
                    s2[r0 // b0 : -(-r1 // b0), c0 // b1 : -(-c1 // b1)],
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


@dataclasses.dataclass(frozen=True, slots=True)
class _PointerCheck:
    """The addresses of many parameters' local tensors, read and compared at C level.

    Built right after each parameter was checked one by one (`Executor._local`); `moved`
    then costs two C-level maps and one list compare, where a Python loop over a MoE model's
    ~19k parameters took longer than the copies. A registered parameter's old storage stays
    alive, so for static batches an unchanged address is unchanged memory; a captured graph
    reads exactly the addresses recorded here, so for it an unchanged address is what it reads.
    """

    params: list[Any]
    getter: Any
    """How to reach each one's local tensor: DTensor's `_local_tensor`, or None (itself)."""
    ptrs: list[int]

    @staticmethod
    def of(params: list[Any]) -> _PointerCheck | None:
        """None for a mix of DTensors and plain tensors (checked one by one instead)."""
        if (
            DTensor is not None
            and params
            and all(
                isinstance(p, DTensor)
                and isinstance(getattr(p, "_local_tensor", None), torch.Tensor)
                for p in params
            )
        ):
            getter: Any = operator.attrgetter("_local_tensor")
        elif DTensor is None or not any(isinstance(p, DTensor) for p in params):
            getter = None
        else:
            return None
        return _PointerCheck(params, getter, _PointerCheck._read(params, getter))

    @staticmethod
    def _read(params: list[Any], getter: Any) -> list[int]:
        return list(map(torch.Tensor.data_ptr, params if getter is None else map(getter, params)))

    def moved(self) -> int | None:
        """Index of the first parameter whose address changed, or None."""
        now = self._read(self.params, self.getter)
        if now == self.ptrs:
            return None
        return next(i for i, (a, b) in enumerate(zip(now, self.ptrs, strict=True)) if a != b)


def _static_batches(tasks: Sequence[Task], static: Mapping[int, _StaticTask]) -> list[_StaticBatch]:
    """Static tasks' writes grouped per engine, in task order, into batches of about
    `_STATIC_BATCH_BYTES` (one prepared batch each instead of one post per task)."""
    open_: dict[str, _StaticBatch] = {}
    sizes: dict[str, int] = {}
    out: list[_StaticBatch] = []
    owned: set[int] = set()  # each task's record goes with the first batch holding its writes
    batch_names: dict[int, set[str]] = {}
    for t in tasks:
        st = static.get(t.task_id)
        if st is None:
            continue
        for peer, ops in st.ops.items():
            batch = open_.get(peer)
            if batch is None or sizes[peer] >= _STATIC_BATCH_BYTES:
                batch = open_[peer] = _StaticBatch(peer, (), [])
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
        (r0, r1), (c0, c1) = [
            (a - o, b - o) for (a, b), o in zip(p.dest_box[-2:], origin[-2:], strict=True)
        ]
        if r0 % b0 or c0 % b1 or (r1 % b0 and r1 != rows) or (c1 % b1 and c1 != cols):
            return None
        if numel(box_shape(p.source_box)) != (r1 - r0) * (c1 - c0):
            return None
        out.append((p, (r0, r1, c0, c1)))
    return out


def trace_events(
    records: Sequence[TaskRecord], *, rank: int, step: int, start_s: float = 0.0
) -> list[dict[str, Any]]:
    """Chrome/Perfetto trace events ("X" complete events, microseconds) for one update.

    `start_s` is when the update started on the caller's timeline (record times count from it),
    so the events of successive updates follow one another instead of overlapping.
    """
    events: list[dict[str, Any]] = []
    for r in records:
        for stage, a, b in (
            ("prepare", r.prepare_start, r.prepare_end),
            ("write", r.write_start, r.write_end),
        ):
            if b > a:
                events.append(
                    {
                        "name": f"task {r.task_id} ({r.kind})",
                        "cat": stage,
                        "ph": "X",
                        "ts": (start_s + a) * 1e6,
                        "dur": (b - a) * 1e6,
                        "pid": rank,
                        "tid": stage,
                        "args": {"bytes": r.nbytes, "step": step},
                    }
                )
    return events
