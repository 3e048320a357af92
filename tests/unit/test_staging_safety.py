"""After a failure no staging memory is freed while a write may still read it.

A deliberately slow transport (the real loopback underneath; each batch's bytes are read only
`DELAY_S` after it was posted, longer than the executor's settle wait) carries the first batch
of update 1, and the rank's preparation of a later task raises. At the moment the slow write
finally reads its staging bytes, the test checks that no part of them was returned to the
arena since the batch was posted; the next update runs meanwhile (the quarantined block stays
reserved) and the one after that reclaims it, with every engine tensor exact.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.unit._inprocess import Cluster
from tests.unit.test_layouts import (
    TINY,
    check_engine,
    expected_vllm,
    hf_weights,
    make_engines,
    shards_for,
)
from weight_transfer.backends.base import WeightTransferError, WriteHandle
from weight_transfer.pipeline import write as write_stage
from weight_transfer.sender import WeightSender

DELAY_S = write_stage.QUIESCE_S + 1.0


class Boom(Exception):
    """The injected failure."""


class SlowFirstBatch:
    """Wraps one sender's transport: the first batch posted while armed is read late."""

    def __init__(self, sender: WeightSender) -> None:
        self.ex = sender._executor
        tr = self.tr = self.ex.transport
        self.real_post, self.real_poll = tr.post_writes, tr.poll
        self.real_event = tr.completion_event
        self.armed = True
        self.slow: list[WriteHandle] = []
        self.frees: list[tuple[float, int, int]] = []
        self.violations: list[str] = []
        self.read_at: float | None = None
        arena = self.ex.arena
        real_free = arena.free

        def free(offset: int, nbytes: int) -> None:
            self.frees.append((time.monotonic(), offset, nbytes))
            real_free(offset, nbytes)

        arena.free = free  # type: ignore[method-assign]
        tr.post_writes = self.post_writes  # type: ignore[method-assign]
        tr.poll = self.poll  # type: ignore[method-assign]
        tr.completion_event = self.completion_event  # type: ignore[method-assign]

    def post_writes(self, peer, ops):
        staged = [o for o in ops if o.source is self.ex.arena.region]
        if not (self.armed and staged and not self.slow):
            return self.real_post(peer, ops)
        h = WriteHandle(-1, peer, len(ops), sum(o.nbytes for o in ops), time.monotonic())
        self.slow.append(h)
        posted = time.monotonic()

        def late() -> None:
            time.sleep(DELAY_S)
            self.read_at = time.monotonic()
            for t, off, n in self.frees:
                for o in staged:
                    if (
                        t >= posted
                        and off < o.source_offset + o.nbytes
                        and o.source_offset < off + n
                    ):
                        self.violations.append(
                            f"staging [{off}, {off + n}) freed {t - posted:.2f} s after the post, "
                            f"before the write read [{o.source_offset}, "
                            f"{o.source_offset + o.nbytes})"
                        )
            real = self.real_post(peer, ops)
            self.tr.wait(real, 10.0)
            h.done = True

        threading.Thread(target=late, daemon=True).start()
        return h

    def poll(self, h):
        return h.done if h in self.slow else self.real_poll(h)

    def completion_event(self, h):
        return None if h in self.slow else self.real_event(h)


@pytest.mark.timeout(120)
def test_failed_update_never_frees_staging_a_write_still_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hf = hf_weights(TINY, 5)
    engines, befores = make_engines(TINY, 2, fp8=True, block=(128, 128), seed=50)
    state: dict = {}

    def wrap(s: WeightSender) -> None:
        state["slow"] = SlowFirstBatch(s)
        real_q = s._executor.prepare.quantize
        calls = [0]

        def quantize(*args):
            calls[0] += 1
            if state["slow"].armed and calls[0] == 6:
                raise Boom("injected after the slow batch was posted")
            real_q(*args)

        s._executor.prepare.quantize = quantize

    with Cluster(
        monkeypatch,
        hf,
        shards_for(hf, 1, "fsdp", 1),
        engines,
        world=1,
        memory_budget_bytes=8 << 20,
        # One quantized unit per task, so the sixth quantization comes after the first staged
        # batch was posted (batched into larger tasks, it would come before).
        task_target_bytes=64 << 10,
        wrap=wrap,
    ) as cluster:
        slow = state["slow"]
        out = cluster.update(1)
        assert isinstance(out.results[0], WeightTransferError), out.results
        assert "Boom: injected" in str(out.results[0])
        assert slow.slow and not slow.slow[0].done, "the slow batch must outlive the failure"
        assert slow.ex.writes.quarantine, "its staging must be quarantined, not freed"
        slow.armed = False
        ok = cluster.update(2)  # runs while update 1's write is still in flight
        assert not isinstance(ok.results[0], BaseException), ok.results
        deadline = time.monotonic() + 10
        while not slow.slow[0].done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.read_at is not None
        assert slow.violations == []
        with torch.no_grad():
            for t in hf.values():
                t.mul_(-1)
        cluster.refresh_locals()
        ok = cluster.update(3)
        assert not isinstance(ok.results[0], BaseException), ok.results
        assert not slow.ex.writes.quarantine, "settled writes give their staging back"
        for r, e in enumerate(engines):
            assert cluster.receivers[r].version == 3
            check_engine(
                e.name,
                e.tensors,
                befores[r],
                expected_vllm(TINY, hf, r, 2),
                fp8=True,
                block=(128, 128),
            )


def test_ring_slice_is_released_only_by_the_task_that_holds_it() -> None:
    """A graph group's arena slice stays claimed until a prepared task that holds it (`ring`)
    is released; releasing another prepared task with the same first task id (a static batch
    with no task of its own names the schedule's first task) gives back only its own blocks."""
    from weight_transfer.backends.base import TransportConfig, create_transport
    from weight_transfer.pipeline.records import TaskRecord
    from weight_transfer.pipeline.staging import Staging, StagingArena
    from weight_transfer.pipeline.state import Prepared
    from weight_transfer.planner.types import Task

    def task(task_id: int) -> Task:
        return Task(task_id, "direct", 0, (0,), (), (), 0, 0)

    abort = threading.Event()
    with create_transport(TransportConfig(name="loopback")) as tr:
        staging = Staging(StagingArena(tr, 1 << 16, torch.device("cpu")), 1 << 16, rank=0)
        group, other = task(7), task(8)
        assert staging.claim_slice(group, 0, 4096, time.monotonic() + 5, abort)
        staging.release(Prepared(group, TaskRecord(7, "direct", 0), {}, [], 0))
        abort.set()  # the slice is still taken: a claim of an overlapping slice must wait
        assert not staging.claim_slice(other, 1024, 2048, time.monotonic() + 5, abort)
        abort.clear()
        staging.release(Prepared(group, TaskRecord(7, "direct", 0), {}, [], 0, ring=True))
        assert staging.claim_slice(other, 1024, 2048, time.monotonic() + 5, abort)
