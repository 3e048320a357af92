"""`Executor`: one rank's schedule, update after update. It builds the pipeline's parts once
and runs one update through them: the prepare stage on its own thread, the write stage on the
caller's, and on failure the drain that keeps the other ranks' collectives going."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backends.base import (
    RegionDescriptor,
    Transport,
    UpdateAbortedError,
    WeightTransferError,
)
from weight_transfer.errors import UpdateInProgressError
from weight_transfer.pipeline.geometry import ALIGN, round_up
from weight_transfer.pipeline.graphs import GraphGroups, NotGraphable
from weight_transfer.pipeline.prepare import BarrierFn, GatherFn, PrepareStage
from weight_transfer.pipeline.quant import QuantFn, default_quantize
from weight_transfer.pipeline.records import UpdateStats
from weight_transfer.pipeline.sources import SourceBinding, Sources
from weight_transfer.pipeline.staging import Staging, StagingArena
from weight_transfer.pipeline.state import Prepared, RunState
from weight_transfer.pipeline.static import StaticWrites
from weight_transfer.pipeline.versions import VersionWriter
from weight_transfer.pipeline.write import WriteStage
from weight_transfer.planner.types import RankSchedule

log = logging.getLogger(__name__)

STUCK_JOIN_S = 0.5
"""How long `run` waits for the previous update's prepare thread, still running at the start
of a new update, before refusing the new one."""


def arena_bytes(schedule: RankSchedule, memory_budget_bytes: int) -> int:
    """Bytes of the registered staging arena a rank running `schedule` needs: what the
    schedule can stage at once (every task in flight together, each piece aligned as the arena
    hands it out), plus its largest task again, so that an update can always progress while a
    failed update's blocks stay quarantined; capped at half the memory budget (the pipeline's
    admission keeps what is in flight within it). A 4x4 model gets a few KiB, not 512 MiB
    registered and page-faulted per sender."""
    needs = [
        round_up(t.staging_bytes) + 2 * ALIGN * len(t.writes)  # <= 2 aligned blocks per write
        for t in schedule.tasks
        if t.staging_bytes
    ]
    if not needs:
        return ALIGN
    return max(ALIGN, min(memory_budget_bytes // 2, sum(needs) + max(needs)))


class Executor:
    """Runs one rank's schedule, update after update. Built once; `run` per update.

    Its parts, each built once: `sources` (the trainer tensors and their reallocation checks),
    `staging` (arena, scratch budget, graph-group ring), `static` (tasks sent straight from
    registered shards as prepared batches), `graphs` (FP8 graph groups, CUDA only), `prepare`
    and `writes` (the two stages), `versions` (the version words of the commit).
    """

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
        mapped_writes: bool = True,
        table_quantize: bool = True,
    ) -> None:
        """Check the budget, register staging and the version words, build the static batches
        and (on CUDA) capture the graph groups.

        Args:
            mapped_writes: graph groups quantize straight into engine memory that the
                transport maps on this GPU (`Transport.mapped_view`) instead of staging it.
            table_quantize: graph groups quantize through one `QuantTable` launch per block
                shape and dtype; False captures one kernel per call (`SenderConfig`).

        Raises:
            WeightTransferError: a task needs more staging than half the memory budget, or a
                registered parameter was reallocated.
        """
        self.rank = rank
        self.schedule = schedule
        self.transport = transport
        self.device = device
        half = memory_budget_bytes // 2
        too_big = [t for t in schedule.tasks if t.staging_bytes > half]
        if too_big:
            t = too_big[0]
            raise WeightTransferError(
                f"trainer rank {rank}: task {t.task_id} needs {t.staging_bytes} staging bytes, "
                f"more than half the memory budget ({half}); raise memory_budget_bytes "
                "or plan with a smaller max_write_bytes"
            )
        self.arena = StagingArena(transport, arena_bytes(schedule, memory_budget_bytes), device)
        # Scratch keeps its half whatever the arena takes: the plan was made for that split.
        self.staging = Staging(self.arena, memory_budget_bytes - half, rank)
        self.versions = VersionWriter(
            transport, schedule.version_engines, descriptors, version_regions
        )
        # torch.cuda.Stream/Event constructors are unannotated in torch's stubs.
        self._stream = (
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )
        self.sources = Sources(sources, rank)
        self.static = StaticWrites(schedule, self.sources, descriptors)
        self.graphs = GraphGroups({}, set())
        if self._stream is not None:
            try:
                self.graphs = GraphGroups.capture(
                    rank=rank,
                    tasks=schedule.tasks,
                    static=self.static,
                    sources=self.sources,
                    descriptors=descriptors,
                    transport=transport,
                    arena=self.arena,
                    device=device,
                    stream=self._stream,
                    quantize=quantize,
                    mapped_writes=mapped_writes,
                    table_quantize=table_quantize,
                    group_budget_bytes=half,
                )
            except NotGraphable as why:
                log.info("trainer rank %d: per-task graphs not used: %s", rank, why)
            except RuntimeError as exc:  # capture refused (driver, allocator): run eagerly
                log.warning(
                    "trainer rank %d: CUDA graph capture failed, running eagerly: %s", rank, exc
                )
                torch.cuda.synchronize(device)
        self.prepare = PrepareStage(
            rank=rank,
            schedule=schedule,
            sources=self.sources,
            descriptors=descriptors,
            staging=self.staging,
            device=device,
            stream=self._stream,
            gather=gather,
            barrier=barrier,
            quantize=quantize,
            static=self.static,
            graphs=self.graphs,
        )
        self.writes = WriteStage(
            rank=rank,
            transport=transport,
            staging=self.staging,
            static=self.static,
            graphs=self.graphs,
        )
        self._worker: threading.Thread | None = None
        """The prepare thread of the last update that had one."""
        self._worker_step = 0
        self._outlived: RunState | None = None
        """The state of an update whose prepare thread outlived it: what that thread hands
        over after the update ended is released once it ends."""

    def busy(self) -> str | None:
        """Why a new update cannot start now: the prepare thread of update k outlived its
        deadline and still runs (blocked in a collective), or None."""
        worker = self._worker
        if worker is None or not worker.is_alive():
            return None
        doing = self.prepare.doing or "preparing"
        return f"the preparation of update {self._worker_step} is still running ({doing})"

    def _refuse_if_busy(self, step: int) -> None:
        """At most one update's threads are ever alive: a prepare thread that outlived its
        update would enter this update's gathers and barriers alongside the new one."""
        if self._worker is not None and self._worker.is_alive():
            self._worker.join(STUCK_JOIN_S)
        why = self.busy()
        if why is None and self._outlived is not None:
            self._release_ready(self._outlived)
            self._outlived = None
        if why is not None:
            raise UpdateInProgressError(
                f"trainer rank {self.rank}: update {step} refused: {why} past its deadline; "
                "it ends when its collective returns or times out (the process group's "
                "timeout); until then no update can start on this rank. To go on sooner, "
                "rebuild the process group and the WeightSender",
                step=step,
            )

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

        At most one update's threads are alive: if the prepare thread of an earlier update
        outlived its deadline (blocked in a collective) and does not end within
        `STUCK_JOIN_S`, the update is refused before anything starts.

        Raises:
            UpdateInProgressError: an earlier update's prepare thread still runs (reported
                through `on_failure` first, like any failure of this rank).
            TransportTimeoutError: the update ran past `timeout_s`.
            UpdateAbortedError: `cancelled` reported another rank's failure.
            WeightTransferError: a stage failed (the message names the task and peer); any
                other exception of a stage is raised as it is.
        """
        try:
            self._refuse_if_busy(step)
        except UpdateInProgressError as exc:
            if on_failure is not None:
                on_failure(exc)  # the other ranks stop at once, naming this rank's reason
            raise
        st = RunState(
            step=step,
            t0=time.perf_counter(),
            deadline=time.monotonic() + timeout_s,
            timeout_s=timeout_s,
            ready=queue.Queue(),
            abort=threading.Event(),
            cancelled=cancelled,
        )
        self.writes.settle_quarantine()
        caller_done = self._order_after_caller()
        self.staging.reset_peaks()
        # When every task is a static batch (and there are no mesh-group barriers to enter),
        # there is nothing to prepare: no prepare thread, whose start costs more than posting.
        worker: threading.Thread | None = None
        if self.prepare.needed:
            worker = threading.Thread(
                target=self.prepare.loop,
                args=(st,),
                name=f"wt-prepare-r{self.rank}",
                daemon=True,
            )
            self._worker, self._worker_step = worker, step
            # Preparation starts at once; a failure while posting the static batches sets
            # `abort`, and the prepare stage then only enters its collectives.
            worker.start()
        else:
            st.finished_preparing = True
        try:
            self.writes.run(st, caller_done)
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
            peak_scratch_bytes=self.staging.scratch_peak,
            records=tuple(sorted(st.records, key=lambda r: r.task_id)),
            num_writes=st.num_writes,
            post_seconds=st.post_seconds,
        )

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

    def _fail(
        self,
        st: RunState,
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
        self.writes.quiesce(st.in_flight)
        if worker is None:  # nothing to prepare: no collectives, nothing in the ready queue
            return
        if worker.ident is None:
            worker.start()  # abort is set: it only enters this rank's collectives
        worker.join(timeout=max(0.1, st.deadline - time.monotonic()))
        if worker.is_alive():
            log.warning(
                "trainer rank %d: preparation of update %d still running at its deadline (%s); "
                "the next update on this rank is refused until it ends",
                self.rank,
                st.step,
                self.prepare.doing or "preparing",
            )
            self._outlived = st
        for p in st.waiting:
            self.staging.release(p)
        self._release_ready(st)

    def _release_ready(self, st: RunState) -> None:
        """Release what the prepare stage prepared but the write stage never posted."""
        while True:
            try:
                item = st.ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Prepared):
                self.staging.release(item)

    def write_versions(self, step: int, timeout_s: float) -> None:
        """Write `step` into the version word of every engine this rank commits."""
        self.versions.write(step, timeout_s)

    def close(self) -> None:
        """Release registrations made by the executor."""
        for r in (self.arena.region, self.versions.region, *self.versions.retired):
            try:
                self.transport.deregister(r)
            except (ValueError, WeightTransferError):
                pass
