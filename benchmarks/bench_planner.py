"""Benchmark the planner and the simulator on a cluster preset (default: Kimi-K2, 256 -> 128).

Prints the seconds and peak resident memory of building manifests, planning and simulating,
then the predicted update time beside its lower bound and the rank-0 broadcast baseline, and
writes the numbers as JSON.

    python benchmarks/bench_planner.py --preset kimi-k2 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from weight_transfer.planner.plan import PlannerConfig, plan
from weight_transfer.planner.presets.clusters import cluster_manifests, get_preset, model_bytes
from weight_transfer.planner.replan import Replanner
from weight_transfer.planner.simulate import broadcast_baseline, simulate
from weight_transfer.planner.types import DestManifest, DestRegion, dtype_size, numel


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """What to run."""

    preset: str = "kimi-k2"
    """Cluster preset name."""
    repeats: int = 1
    """Planner runs (the median is reported)."""
    gather_fp8: bool = False
    """Plan with `PlannerConfig.quantize_in_shards` off (every FP8 unit spanning ranks gathered)."""
    json_path: str | None = None
    """Where to write the results."""
    simulate: bool = True
    """Also simulate the schedule (predicted update time); off: planning and re-planning only."""
    replans: int = 3
    """Re-plans timed after the last plan, each after one engine rejoined at a new placement."""


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rss_now_gib() -> float:
    """Resident memory now (Linux), not the peak: what the inputs and the schedule keep."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def max_rank_plan_bytes(schedule: Any, dests: Any) -> int:
    """The largest rank's `RankPlan` as the control plane stores it (msgpack, sealed), which
    must fit one store value (`weight_transfer.control.MAX_VALUE_BYTES`)."""
    from weight_transfer.control import MAX_VALUE_BYTES  # noqa: F401 - the limit it must meet
    from weight_transfer.planner import codec
    from weight_transfer.protocol import EnginePeer, RankPlan

    by_engine = {d.engine: d for d in dests}
    largest = 0
    for rs in schedule.ranks:
        plan_msg = RankPlan(
            fingerprint=schedule.fingerprint,
            schedule=rs,
            engines=tuple(
                EnginePeer(
                    name=e,
                    endpoint=bytes(64),
                    descriptors=tuple(
                        r.descriptor for r in sorted(by_engine[e].regions, key=lambda r: r.index)
                    ),
                    version_region=by_engine[e].version_region,
                )
                for e in rs.peers
            ),
        )
        largest = max(largest, len(codec.to_msgpack(plan_msg)) + 28)  # nonce + tag
    return largest


def rejoined(d: DestManifest) -> DestManifest:
    """`d` as an engine that restarted brings it: the same tensors at new offsets (reverse
    order, 512-byte aligned after a 4 KiB header) of a new region 0, new descriptors and host."""
    offset = 4096
    at = {}
    for t in reversed(d.tensors):
        at[t.name] = offset
        offset += -(-(numel(t.shape) * dtype_size(t.dtype)) // 512) * 512
    return dataclasses.replace(
        d,
        host=d.host + "-restarted",
        regions=(DestRegion(0, offset, b"rejoined:" + d.engine.encode()), *d.regions[1:]),
        tensors=tuple(dataclasses.replace(t, offset_bytes=at[t.name]) for t in d.tensors),
    )


def run(cfg: BenchConfig) -> dict[str, object]:
    """Build manifests, plan and simulate; returns the measured numbers."""
    preset = get_preset(cfg.preset)
    t0 = time.perf_counter()
    sources, dests = cluster_manifests(preset)
    t_manifests = time.perf_counter() - t0
    rss_manifests = _rss_gib()
    config = PlannerConfig(quantize_in_shards=not cfg.gather_fp8)
    times = []
    cpu_times = []
    schedule = None
    replanner = None
    for i in range(cfg.repeats):
        schedule = None  # one schedule alive at a time: the peak RSS is one plan's
        t0, c0 = time.perf_counter(), time.process_time()
        if i < cfg.repeats - 1:
            schedule = plan(sources, dests, config)
        else:
            # The same planning (`Replanner` plans from scratch the first time), kept for the
            # re-plans below.
            replanner = Replanner(sources, config)
            schedule = replanner.plan(dests)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    assert schedule is not None and replanner is not None
    rss_plan = _rss_gib()
    rss_kept = _rss_now_gib()
    # Re-plans: engine k (a different one each time) restarted and joined with its tensors
    # elsewhere; the Replanner rewrites the tasks writing into it and reuses the rest.
    replan_s: list[float] = []
    replan_cpu_s: list[float] = []
    current = list(dests)
    for i in range(cfg.replans):
        k = (i * 37 + len(dests) // 2) % len(dests)
        current[k] = rejoined(dests[k])
        t0, c0 = time.perf_counter(), time.process_time()
        replanner.plan(current)
        replan_s.append(time.perf_counter() - t0)
        replan_cpu_s.append(time.process_time() - c0)
        assert replanner.reused_last, "the re-plan should have reused the last schedule"
        current[k] = dests[k]
    rss_replan = _rss_gib()
    out: dict[str, object] = {
        "preset": cfg.preset,
        "quantize_in_shards": not cfg.gather_fp8,
        "describe": preset.describe(),
        "num_manifest_entries": sum(len(m.tensors) for m in sources),
        "manifests_s": t_manifests,
        "plan_s_median": sorted(times)[len(times) // 2],
        "plan_s_all": times,
        "plan_cpu_s_all": cpu_times,
        "replan_one_engine_s_all": replan_s,
        "replan_one_engine_cpu_s_all": replan_cpu_s,
        "load_average_1min": os.getloadavg()[0],
        "peak_rss_gib_after_manifests": rss_manifests,
        "peak_rss_gib": rss_plan,
        "rss_gib_after_plan": rss_kept,
        "peak_rss_gib_after_replans": rss_replan,
        "num_tasks": sum(len(r.tasks) for r in schedule.ranks),
        "num_writes": sum(len(t.writes) for r in schedule.ranks for t in r.tasks),
        "bytes_per_rank_max": max(schedule.bytes_per_rank),
        "bytes_per_rank_min": min(schedule.bytes_per_rank),
    }
    if not cfg.simulate:
        return out
    # Correctness before timing matters: every engine receives what its tensors hold.
    engine_sizes = {d.engine: sum(t.nbytes for t in d.regions if t.index == 0) for d in dests}
    t0 = time.perf_counter()
    result = simulate(
        schedule,
        sources,
        {d.engine: d.host for d in dests},
        preset.rates,
        memory_budget_bytes=config.memory_budget_bytes,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    t_sim = time.perf_counter() - t0
    train_bytes, replica_bytes = model_bytes(preset)
    base = broadcast_baseline(
        train_bytes, list(schedule.bytes_per_engine), preset.rates, fp8=preset.engine.fp8
    )
    out.update(
        {
            "simulate_s": t_sim,
            "total_write_bytes": result.total_write_bytes,
            "max_engine_region_bytes": max(engine_sizes.values()),
            "predicted_s": result.predicted_s,
            "control_plane_s": result.control_plane_s,
            "update_s": result.update_s,
            "max_rank_plan_bytes": max_rank_plan_bytes(schedule, dests),
            "lower_bound_s": result.lower_bound_s,
            "predicted_over_bound": result.predicted_s / result.lower_bound_s,
            "bottleneck": result.bottleneck,
            "stage_bound_s": result.stage_bound_s,
            "trainer_nic_imbalance": result.trainer_nic_bytes.imbalance,
            "engine_nic_imbalance": result.engine_nic_bytes.imbalance,
            "baseline_s": base.predicted_s,
            "trainer_model_bytes": train_bytes,
            "engine_replica_bytes": replica_bytes,
        }
    )
    return out


def main() -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--gather-fp8", action="store_true", help="quantize_in_shards off")
    ap.add_argument("--no-simulate", action="store_true", help="time planning only")
    ap.add_argument("--replans", type=int, default=3, help="one-engine re-plans to time")
    ns = ap.parse_args()
    cfg = BenchConfig(
        preset=ns.preset,
        repeats=ns.repeats,
        json_path=ns.json_path,
        gather_fp8=ns.gather_fp8,
        simulate=not ns.no_simulate,
        replans=ns.replans,
    )
    out = run(cfg)
    for k, v in out.items():
        print(f"{k}: {v}")
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
