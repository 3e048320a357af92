"""At most one update's threads are alive on a trainer rank.

A prepare thread blocked in a collective (a gather whose peer never comes) outlives its
update's deadline: the update fails on every rank, but the thread stays alive, and it would
enter the next update's gathers and barriers next to that update's own thread (gloo matches
collectives by order: data of one update would land in the other's). A new update on that rank
is refused with `UpdateInProgressError` (naming the update and the collective the old thread is
in) until the old thread ends; then updates land again.

Two trainer ranks and one engine in this process (`tests.unit._inprocess`), sources sharded so
that only a gather rebuilds them; rank 1's first gather of update 1 blocks until the test lets
it go.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.unit._inprocess import Cluster, Engine, strided_shards
from weight_transfer import sender as sender_module
from weight_transfer.errors import UpdateInProgressError, WeightTransferError
from weight_transfer.planner.recipes import identity

SHAPES = {"a.weight": (64, 32), "b.weight": (48,)}


def _prepare_threads(rank: int) -> int:
    return sum(t.name == f"wt-prepare-r{rank}" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(120)
def test_a_prepare_thread_that_outlives_its_update_blocks_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(41)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    engine = Engine(
        name="e0",
        recipes=tuple(identity(n, n, s) for n, s in SHAPES.items()),
        tensors={n: torch.randn(s, generator=g) for n, s in SHAPES.items()},
    )
    shards = {n: strided_shards(2) for n in SHAPES}
    with Cluster(
        monkeypatch, full, shards, [engine], world=2, timeout_s=10, update_timeout_s=1.5
    ) as cluster:
        gather = sender_module.full_tensor
        blocked, release = threading.Event(), threading.Event()
        arm = {"on": True}
        seen_alive: list[int] = []

        def full_tensor(t: torch.Tensor, device: object = None) -> torch.Tensor:
            if threading.current_thread().name == "wt-prepare-r1":
                seen_alive.append(_prepare_threads(1))
                if arm["on"]:
                    arm["on"] = False
                    blocked.set()
                    release.wait(60)  # a gather whose peer does not come
            return gather(t, device)

        monkeypatch.setattr(sender_module, "full_tensor", full_tensor)
        try:
            first = cluster.update(1)
            assert blocked.is_set()
            for r in (0, 1):
                assert isinstance(first.results[r], WeightTransferError), first.results[r]
            assert "trainer rank 1" in str(first.results[0])
            assert _prepare_threads(1) == 1  # the thread outlived its update

            second = cluster.update(2)
            print(
                f"\nupdate 2 refused after {second.seconds[1]:.3f} s on rank 1, "
                f"failed after {second.seconds[0]:.3f} s on rank 0"
            )
            refused = second.results[1]
            assert isinstance(refused, UpdateInProgressError), refused
            assert "update 2 refused" in str(refused) and "update 1 is still running" in str(
                refused
            )
            assert "gathering 'a.weight'" in str(refused) or "gathering 'b.weight'" in str(refused)
            other = second.results[0]
            assert isinstance(other, WeightTransferError) and "trainer rank 1" in str(other)
            assert "refused" in str(other)
            # Never two prepare threads on rank 1, not even for a moment.
            assert max(seen_alive) == 1, seen_alive
            assert cluster.receivers[0].version == 0
        finally:
            release.set()
        deadline = time.monotonic() + 30
        while _prepare_threads(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _prepare_threads(1) == 0

        with torch.no_grad():
            for t in full.values():
                t.add_(torch.randn(t.shape, generator=g))
        cluster.refresh_locals()
        third = cluster.update(3)
        for r in (0, 1):
            assert not isinstance(third.results[r], BaseException), third.results[r]
        assert max(seen_alive) == 1, seen_alive
        assert cluster.receivers[0].version == 3
        for n, t in full.items():
            assert torch.equal(engine.tensors[n], t), n
