"""Any exception in any stage of any rank fails the update on every rank at once.

Three trainer ranks (FSDP2 shards) update four FP8 engines (tp=4) in one process through the
real runtime (`tests.unit._inprocess`). One rank is made to raise a plain exception (not one of
ours) in one stage: preparation (the quantizer), posting writes, or writing version words. Every
rank must raise within seconds (the timeouts are 30 s), naming the failing rank and the
exception; no engine's version word advances (after a failure while version words are written,
the words already written are set back: every rank of a replica shows the same update, and
`wait_for_version` never reports the failed one); the next update lands exactly.
"""

from __future__ import annotations

import threading

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
from weight_transfer.backends.base import WeightTransferError
from weight_transfer.errors import UpdateFailedError
from weight_transfer.sender import WeightSender

FAIL_WITHIN_S = 5.0
"""Every rank raises within this (the control plane and update timeouts are 30 s)."""


class Boom(Exception):
    """The injected failure: deliberately not a WeightTransferError."""


def _inject(stage: str, armed: dict[str, bool]):
    def wrap(s: WeightSender) -> None:
        if s.rank != 2:
            return
        ex = s._executor
        if stage == "prepare":
            real_q = ex.prepare.quantize

            def quantize(*args):
                if armed["on"]:
                    raise Boom("injected in the quantizer")
                real_q(*args)

            ex.prepare.quantize = quantize
        elif stage == "write":
            tr = ex.transport
            real_post = tr.post_writes

            def post_writes(peer, ops):
                if armed["on"]:
                    raise Boom(f"injected posting to {peer}")
                return real_post(peer, ops)

            tr.post_writes = post_writes  # type: ignore[method-assign]
        else:
            real_wv = ex.write_versions

            def write_versions(step, timeout_s):
                real_wv(step, timeout_s)
                if armed["on"] and step > 0:
                    # The words landed (as when an acknowledgement is lost): record what the
                    # engines show before the roll-back, then fail.
                    armed["before_rollback"] = [rx.version for rx in armed["receivers"]]
                    raise Boom("injected writing version words")

            ex.write_versions = write_versions  # type: ignore[method-assign]

    return wrap


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["prepare", "write", "commit"])
def test_plain_exception_fails_every_rank_fast(monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    hf = hf_weights(TINY, 7)
    engines, befores = make_engines(TINY, 4, fp8=True, block=(128, 128), seed=70)
    armed: dict = {"on": True, "receivers": []}
    with Cluster(
        monkeypatch,
        hf,
        shards_for(hf, 3, "fsdp", 1),
        engines,
        world=3,
        timeout_s=30.0,
        update_timeout_s=30.0,
        wrap=_inject(stage, armed),
    ) as cluster:
        armed["receivers"] = cluster.receivers
        seen: dict[str, object] = {}

        def watch(rx) -> None:
            try:
                seen[rx.engine] = rx.wait_for_version(1, 20.0)
            except WeightTransferError as exc:
                seen[rx.engine] = exc

        watchers = [threading.Thread(target=watch, args=(rx,)) for rx in cluster.receivers]
        for t in watchers:
            t.start()
        out = cluster.update(1)
        for t in watchers:
            t.join(30)
        for r in range(3):
            exc = out.results[r]
            # Typed: every rank raises the retryable UpdateFailedError for update 1.
            assert isinstance(exc, UpdateFailedError), f"rank {r} returned {exc!r}"
            assert exc.step == 1 and exc.retryable
            text = str(exc)
            assert "update 1" in text and "trainer rank 2" in text and "Boom: injected" in text, (
                text
            )
            assert out.seconds[r] < FAIL_WITHIN_S, f"rank {r} took {out.seconds[r]:.1f} s to fail"
        assert isinstance(out.results[2].__cause__, Boom)
        # Whole updates: no engine shows update 1, also after a failure while the version
        # words were being written (the words other ranks wrote are set back), and no
        # engine waiting for it was told it arrived.
        if stage == "commit":
            assert 1 in armed["before_rollback"], armed["before_rollback"]
        for rx in cluster.receivers:
            assert rx.version == 0, (stage, rx.engine, rx.version)
            assert isinstance(seen[rx.engine], UpdateFailedError), (rx.engine, seen[rx.engine])
        armed["on"] = False
        with torch.no_grad():
            for t in hf.values():
                t.mul_(-1)
        cluster.refresh_locals()
        ok = cluster.update(2)
        bad = {r: v for r, v in ok.results.items() if isinstance(v, BaseException)}
        assert not bad, f"the update after the failure failed: {bad}"
        for r, e in enumerate(engines):
            assert cluster.receivers[r].wait_for_version(2, 5.0) == 2
            check_engine(
                e.name,
                e.tensors,
                befores[r],
                expected_vllm(TINY, hf, r, 4),
                fp8=True,
                block=(128, 128),
            )


@pytest.mark.timeout(120)
def test_a_failure_report_does_not_wait_behind_the_ranks_own_barrier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 40, finding 9. Rank 1's write stage fails while its prepare thread waits in the
    barrier of mesh group 1 for rank 0, which is still preparing group 0 (a 3 s gather). The
    barrier's wait and the failure report shared one store connection, which serves one
    request at a time: `abort/1` was published only when rank 0 reached the barrier. It must
    be published at once (and so reach rank 0 while it still prepares)."""
    import time

    from tests.unit._inprocess import Engine
    from weight_transfer.control import ControlPlane
    from weight_transfer.planner.recipes import identity
    from weight_transfer.protocol import Failure

    shape = (16, 8)
    g = torch.Generator().manual_seed(91)
    hf = {n: torch.randn(shape, generator=g) for n in ("a1", "a2", "b")}
    # a1, a2 on mesh (0, 1), b on mesh (1, 0): two overlapping meshes, two mesh groups.
    shards = {
        "a1": [(None, (0, 1))] * 2,
        "a2": [(None, (0, 1))] * 2,
        "b": [(None, (1, 0))] * 2,
    }
    engine = Engine(
        "e0",
        tuple(identity(n, n, shape) for n in hf),
        {n: torch.randn(shape, generator=g) for n in hf},
    )
    armed = {"on": True}
    failed_at: list[float] = []

    def wrap(s: WeightSender) -> None:
        ex = s._executor
        if s.rank == 0:
            real_gather = ex.prepare.gather

            def slow_gather(t):
                if armed["on"]:
                    armed["on"] = False
                    time.sleep(3.0)  # rank 0 is still preparing mesh group 0
                return real_gather(t)

            ex.prepare.gather = slow_gather
        else:
            real_post = ex.transport.post_writes

            def post_writes(peer, ops):
                if not failed_at:
                    time.sleep(0.3)  # meanwhile the prepare thread enters the next barrier
                    failed_at.append(time.monotonic())
                    raise Boom(f"injected posting to {peer}")
                return real_post(peer, ops)

            ex.transport.post_writes = post_writes  # type: ignore[method-assign]

    with Cluster(
        monkeypatch,
        hf,
        shards,
        [engine],
        world=2,
        timeout_s=30.0,
        update_timeout_s=30.0,
        wrap=wrap,
    ) as cluster:
        schedule = cluster.controller.schedule
        assert schedule is not None and schedule.ranks[1].num_mesh_groups == 2
        assert any(t.mesh_group == 0 and t.writes for t in schedule.ranks[1].tasks)
        heard: list[float] = []
        watcher = ControlPlane(cluster.control, server=False, member="test watcher")

        def watch() -> None:
            report = watcher.get("abort/1", Failure, 30.0)
            assert "Boom" in report.message, report.message
            heard.append(time.monotonic())

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            out = cluster.update(1)
            thread.join(30)
        finally:
            watcher.close()
        assert failed_at and heard, (failed_at, heard)
        late = heard[0] - failed_at[0]
        assert late < 1.0, f"abort/1 was published {late:.1f} s after rank 1 failed"
        for r in range(2):
            exc = out.results[r]
            assert isinstance(exc, UpdateFailedError), f"rank {r} returned {exc!r}"
            assert "trainer rank 1" in str(exc) and "Boom: injected" in str(exc), str(exc)
        assert cluster.receivers[0].version == 0
