"""A step is consumed when `update` starts; a rank that cannot read a verdict sets its words back.

Two trainer ranks (FSDP2 shards) update two engines in one process through the real runtime
(`tests.unit._inprocess`). Rank 1's control plane is made to lose one verdict (its wait for it
raises `TransportTimeoutError`, as when the controller answers late). Issue 40, finding 6: the
rank then took `update(k)` again, reading the first attempt's `go/k`, `commit/k` and `result/k`,
so the controller could commit words while the rank had not written this attempt's bytes; and
the version words it wrote stayed at k whatever the verdict was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit._inprocess import Cluster, Engine, fsdp_shards
from weight_transfer.backends.base import TransportTimeoutError
from weight_transfer.errors import UpdateFailedError
from weight_transfer.planner.recipes import identity

SHAPES = {"a.weight": (64, 32), "b.weight": (48, 16)}


def _cluster(monkeypatch: pytest.MonkeyPatch) -> Cluster:
    g = torch.Generator().manual_seed(61)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    engines = [
        Engine(
            f"e{i}",
            tuple(identity(n, n, s) for n, s in SHAPES.items()),
            {n: torch.randn(s, generator=g) for n, s in SHAPES.items()},
        )
        for i in range(2)
    ]
    shards = {n: fsdp_shards(s, 2) for n, s in SHAPES.items()}
    return Cluster(
        monkeypatch, full, shards, engines, world=2, timeout_s=10.0, update_timeout_s=2.0
    )


def _lose_verdict(cluster: Cluster, key: str) -> dict[str, int]:
    """Rank 1's next read of `key` times out (the value may be there: the reply is lost)."""
    cp = cluster.senders[1]._control
    real_get = cp.get
    lost = {"n": 0}

    def get(k: str, cls: Any, timeout_s: float | None = None) -> Any:
        if k == key and not lost["n"]:
            lost["n"] += 1
            raise TransportTimeoutError(f"injected: lost the reply for {k!r}")
        return real_get(k, cls, timeout_s)

    cp.get = get  # type: ignore[method-assign]
    return lost


def _next_weights(cluster: Cluster, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in cluster.full.values():
        t.copy_(torch.randn(t.shape, generator=g))
    cluster.refresh_locals()


def _check(cluster: Cluster) -> None:
    for e in cluster.engines:
        for n, t in e.tensors.items():
            assert torch.equal(t, cluster.full[n]), f"{e.name} {n}"


@pytest.mark.timeout(60)
def test_a_step_is_consumed_when_update_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    with _cluster(monkeypatch) as cluster:
        lost = _lose_verdict(cluster, "commit/1")

        def rank(r: int) -> object:
            s = cluster.senders[r]
            try:
                return s.update(1)
            except TransportTimeoutError as first:
                assert r == 1 and "injected" in str(first)
            try:
                return s.update(1)  # the user's retry of the same step
            except ValueError as exc:
                return exc

        out = cluster._on_every_rank(rank, 30.0)
        assert lost["n"] == 1
        retry = out.results[1]
        assert isinstance(retry, ValueError), f"rank 1's retry of step 1 returned {retry!r}"
        assert "must be larger than the previous (1)" in str(retry)
        # Rank 1 never reported committing: the update fails on rank 0, naming it.
        assert isinstance(out.results[0], UpdateFailedError), out.results[0]
        assert "trainer rank 1" in str(out.results[0])
        assert all(rx.version == 0 for rx in cluster.receivers)
        _next_weights(cluster, 62)
        out = cluster.update(2)
        assert not any(isinstance(v, BaseException) for v in out.results.values()), out.results
        assert [rx.wait_for_version(2, 5.0) for rx in cluster.receivers] == [2, 2]
        _check(cluster)


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_read_the_result_sets_its_words_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _cluster(monkeypatch) as cluster:
        mine = set(cluster.senders[1].schedule.version_engines)
        assert mine, "rank 1 writes no version word: the test would check nothing"
        lost = _lose_verdict(cluster, "result/1")
        out = cluster.update(1)
        assert lost["n"] == 1
        assert isinstance(out.results[1], TransportTimeoutError), out.results[1]
        # Rank 1 cannot know whether update 1 committed: no word it wrote may claim it did.
        for rx in cluster.receivers:
            if rx.engine in mine:
                assert rx.version == 0, f"{rx.engine} reads {rx.version} after the roll-back"
        with pytest.raises(ValueError, match="must be larger"):
            cluster.senders[1].update(1)
        _next_weights(cluster, 63)
        out = cluster.update(2)
        assert not any(isinstance(v, BaseException) for v in out.results.values()), out.results
        assert [rx.wait_for_version(2, 5.0) for rx in cluster.receivers] == [2, 2]
        _check(cluster)
