"""The control plane's work per member per update is O(1): it grows neither with the number of
members nor with how long the update's writes take, and nothing polls between updates.

Runs `bench control-plane`'s cluster (real controller, senders and receivers as threads, store
requests counted per member) at two sizes and two data-plane lengths. Before blocking waits,
a trainer rank checked for another rank's failure every 20 ms of its writes and an engine
checked the controller's verdicts every 50 ms, also while idle.
"""

from __future__ import annotations

import dataclasses

import pytest

from weight_transfer.benchmarks.bench_control_plane import BenchControlPlaneConfig, run_cluster


@pytest.mark.timeout(300)
def test_requests_per_member_per_update_are_constant() -> None:
    cfg = BenchControlPlaneConfig(
        members=(4,), updates=2, warmups=1, idle_s=1.0, data_plane_s=0.0, timeout_s=60
    )
    runs = {
        ("small", "instant"): run_cluster(4, cfg, print),
        ("small", "1 s"): run_cluster(4, dataclasses.replace(cfg, data_plane_s=1.0), print),
        ("large", "1 s"): run_cluster(12, dataclasses.replace(cfg, data_plane_s=1.0), print),
    }
    trainer = {k: r["requests_per_update_per_trainer_rank_max"] for k, r in runs.items()}
    engine = {k: r["requests_per_update_per_engine_max"] for k, r in runs.items()}
    # A trainer rank: go, done, commit, committed, result, its failure watch: ~10 requests.
    assert max(trainer.values()) <= 12, trainer
    assert min(trainer.values()) == max(trainer.values()), trainer
    # An engine: the verdict (a wait and a read) and its acknowledgement.
    assert max(engine.values()) <= 4, engine
    for k, r in runs.items():
        assert r["idle_requests_per_s"] == 0, (k, r["idle_requests_per_s_by_kind"])
