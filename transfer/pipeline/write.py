"""The write stage (the calling thread, which alone drives the transport): posts the static
batches, then each prepared task's writes once its device work is done, in order; polls
completions; and returns a task's staging memory only after its writes completed.

After a failure it stops posting and lets the writes already posted settle (`quiesce`);
staging memory a write may still read is never reused: what does not settle in time stays
quarantined until a later update sees it settled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from weight_transfer.backends.base import (
    Transport,
    TransportTimeoutError,
    UpdateAbortedError,
    WeightTransferError,
    WriteHandle,
)
from weight_transfer.pipeline.graphs import GraphGroups
from weight_transfer.pipeline.staging import Staging
from weight_transfer.pipeline.state import CANCEL_POLL_S, InFlight, RunState
from weight_transfer.pipeline.static import StaticWrites

log = logging.getLogger(__name__)

EVENT_SLICE_S = 1e-4
"""Longest the write loop sleeps on a batch's completion event before it looks for newly
prepared tasks again."""
QUIESCE_S = 1.0
"""After a failure, longest the write stage waits for writes in flight to settle before it
quarantines their staging memory and reports."""


def settled(h: WriteHandle) -> bool:
    """The batch completed, or failed and was quiesced: the transport reads none of its
    memory any more (`WriteHandle.settled`; a failure alone does not settle a batch)."""
    return h.settled


class WriteStage:
    """Posts, polls and releases; keeps the quarantine across updates."""

    def __init__(
        self,
        *,
        rank: int,
        transport: Transport,
        staging: Staging,
        static: StaticWrites,
        graphs: GraphGroups,
    ) -> None:
        self.rank = rank
        self.transport = transport
        self.staging = staging
        self.static = static
        self.graphs = graphs
        self.quarantine: list[InFlight] = []
        """Batches of failed updates that had not settled: their staging stays reserved."""

    def run(self, st: RunState, caller_done: Any) -> None:
        """Post the static batches, then move tasks until every one is written. Raises on
        any failure (this rank's, or another's as `st.cancelled` reports it)."""
        self._post_static(st, caller_done)
        while not st.finished_preparing or st.waiting or st.in_flight:
            self._check_cancelled(st)
            self._check_deadline(st)
            progressed = self._take_ready(st)
            progressed |= self._post_waiting(st)
            progressed |= self._reap(st)
            if not progressed and (st.in_flight or st.waiting):
                self._idle(st)

    def _post_static(self, st: RunState, caller_done: Any) -> None:
        """Tasks that send straight from registered shards need no preparation: once the
        caller's work is done, post their prepared batches before anything else."""
        if not self.static.batches:
            return
        if caller_done is not None:
            self._wait_caller(st, caller_done)
        self.static.post(st, self.transport)

    def _wait_caller(self, st: RunState, event: Any) -> None:
        """Host-wait (bounded by the deadline) for the caller's work queued before `run`."""
        while not event.query():
            if time.monotonic() > st.deadline:
                raise TransportTimeoutError(
                    f"trainer rank {self.rank}: update {st.step}: the work queued on the "
                    f"caller's CUDA stream did not finish within {st.timeout_s:.1f} s"
                )
            time.sleep(2e-5)

    def _check_cancelled(self, st: RunState) -> None:
        """Raise once another rank reported a failure of this update."""
        if st.cancelled is None or time.monotonic() < st.next_poll:
            return
        st.next_poll = time.monotonic() + CANCEL_POLL_S
        why = st.cancelled()
        if why:
            raise UpdateAbortedError(f"trainer rank {self.rank}: update {st.step} aborted: {why}")

    def _check_deadline(self, st: RunState) -> None:
        if time.monotonic() > st.deadline:
            stuck = sorted({peer for f in st.in_flight for peer in f.prepared.ops})
            raise TransportTimeoutError(
                f"trainer rank {self.rank}: update {st.step} not complete after "
                f"{st.timeout_s:.1f} s ({len(st.in_flight)} task(s) in flight"
                + (f", waiting on peer(s) {stuck})" if stuck else ")")
            )

    def _take_ready(self, st: RunState) -> bool:
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

    def _post_waiting(self, st: RunState) -> bool:
        """Post tasks whose device work is done, in order."""
        posted = False
        while st.waiting and (st.waiting[0].event is None or st.waiting[0].event.query()):
            p = st.waiting.pop(0)
            t_post = time.perf_counter()
            p.record.write_start = t_post - st.t0
            group = self.graphs.get(p.task.task_id)
            # In flight before posting, as in `StaticWrites.post`.
            handles: list[WriteHandle] = []
            st.in_flight.append(InFlight(p, handles, [p.record]))
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

    def _reap(self, st: RunState) -> bool:
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
            self.staging.release(f.prepared)
            for rec in f.records:
                rec.write_end = end
                st.records.append(rec)
                st.total += rec.nbytes
            finished += 1
        if finished:
            del st.in_flight[:finished]
        return finished > 0

    def _idle(self, st: RunState) -> None:
        """Nothing moved this pass. Sleep on the oldest unfinished batch's completion event
        when its backend completes it on a thread (tcp, loopback host copies, ucx copy
        lanes), so this loop does not take a core from those threads; else back off briefly,
        except on progress-driven transports (ucx, nixl), whose data moves only while polled."""
        event = self._oldest_event(st.in_flight)
        if event is not None:
            event.wait(EVENT_SLICE_S)
        elif not self.transport.progress_driven:
            time.sleep(2e-5)

    def _oldest_event(self, in_flight: list[InFlight]) -> threading.Event | None:
        if not in_flight:
            return None
        for h in in_flight[0].handles:
            if not h.done:
                return self.transport.completion_event(h)
        return None

    def quiesce(self, in_flight: list[InFlight]) -> None:
        """After a failure: wait (at most `QUIESCE_S`) for posted writes to finish or fail,
        then release their staging memory; what is still unsettled is quarantined, not freed,
        so no write can read memory that a later task was given."""
        until = time.monotonic() + QUIESCE_S
        for f in in_flight:
            for h in f.handles:
                # A failed batch may still be running in the backend (a copy thread, requests
                # in flight): wait until it completed or was quiesced, not just until it failed.
                self.transport.quiesce(h, max(0.0, until - time.monotonic()))
            if all(settled(h) for h in f.handles):
                self.staging.release(f.prepared)
            else:
                self.quarantine.append(f)
        in_flight.clear()

    def settle_quarantine(self) -> None:
        """Release quarantined staging memory whose writes have settled since."""
        keep = []
        for f in self.quarantine:
            for h in f.handles:
                try:
                    self.transport.poll(h)
                except WeightTransferError:
                    pass
            if all(settled(h) for h in f.handles):
                self.staging.release(f.prepared)
            else:
                keep.append(f)
        if keep:
            log.warning(
                "trainer rank %d: %d task(s) of a failed update still have writes in flight; "
                "their staging memory stays reserved",
                self.rank,
                len(keep),
            )
        self.quarantine = keep
