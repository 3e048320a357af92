"""Digests of a planned schedule, to show that a change to the planner moves the same bytes.

`schedule_digest` hashes everything a schedule tells the ranks to do (every task, every write,
in order, the version-word owners and the per-rank and per-engine byte counts); the fingerprint
of the inputs is left out, so two planners given the same inputs can be compared even where
only the fingerprint's encoding differs. `rank_summary` is the coarse view of one schedule per
rank (bytes sent, tasks, writes), small enough to store for Kimi-K2 and compare by eye.

    python benchmarks/planner_digest.py --preset kimi-k2 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from weight_transfer.planner.plan import PlannerConfig, plan
from weight_transfer.planner.presets.clusters import cluster_manifests, get_preset
from weight_transfer.planner.types import Schedule


def schedule_digest(schedule: Schedule) -> str:
    """sha256 of what `schedule` moves: tasks and writes in order, version words, byte counts.

    The frozen dataclasses' `repr` is their complete, deterministic content (ints, strings and
    tuples of them), so equal digests mean field-for-field equal tasks."""
    h = hashlib.sha256()
    h.update(repr((schedule.format_version, schedule.num_ranks, schedule.engines)).encode())
    h.update(repr((schedule.num_mesh_groups, schedule.bytes_per_rank)).encode())
    h.update(repr(schedule.bytes_per_engine).encode())
    for rs in schedule.ranks:
        h.update(repr((rs.rank, rs.peers, rs.version_engines, rs.memory_budget_bytes)).encode())
        h.update(repr(rs.num_mesh_groups).encode())
        for t in rs.tasks:
            h.update(repr(t).encode())
    return h.hexdigest()


def rank_summary(schedule: Schedule) -> list[tuple[int, int, int, int]]:
    """Per rank: (rank, bytes sent, tasks, writes)."""
    return [
        (
            rs.rank,
            schedule.bytes_per_rank[rs.rank],
            len(rs.tasks),
            sum(len(t.writes) for t in rs.tasks),
        )
        for rs in schedule.ranks
    ]


def main() -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2")
    ap.add_argument("--json", dest="json_path")
    ns = ap.parse_args()
    sources, dests = cluster_manifests(get_preset(ns.preset))
    t0, c0 = time.perf_counter(), time.process_time()
    schedule = plan(sources, dests, PlannerConfig())
    plan_s, plan_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    gc.disable()  # the digest walks millions of objects; nothing cyclic is made
    summary = rank_summary(schedule)
    out = {
        "preset": ns.preset,
        "plan_s": plan_s,
        "plan_cpu_s": plan_cpu_s,
        "load_average_1min": os.getloadavg()[0],
        "schedule_digest": schedule_digest(schedule),
        "fingerprint": schedule.fingerprint,
        "num_tasks": sum(s[2] for s in summary),
        "num_writes": sum(s[3] for s in summary),
        "bytes_per_engine": list(schedule.bytes_per_engine),
        "ranks": summary,
    }
    print(json.dumps({k: v for k, v in out.items() if k not in ("ranks", "bytes_per_engine")}))
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
