"""`weight-transfer plan` and `weight-transfer simulate`: schedules and predictions for a cluster
preset, from manifests alone (no GPU, no weights)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from weight_transfer.cli.command import Command


def _cluster_args(p: argparse.ArgumentParser) -> None:
    from weight_transfer.planner.presets.clusters import PRESETS

    p.add_argument("--preset", default="kimi-k2", choices=sorted(PRESETS), help="cluster preset")
    g = p.add_argument_group("overrides of the preset")
    g.add_argument("--trainer-gpus", type=int, help="trainer ranks")
    g.add_argument("--dense-shard", type=int, help="FSDP shard group of non-expert parameters")
    g.add_argument("--expert-shard", type=int, help="ranks per expert mesh")
    g.add_argument("--offload", action="store_true", default=None, help="FSDP2 CPU offload")
    g.add_argument("--engine-replicas", type=int, help="engine replicas")
    g.add_argument("--engine-tp", type=int, help="engine tensor-parallel size")
    g.add_argument("--engine-ep", type=int, help="engine expert-parallel size")
    g.add_argument("--engine-bf16", action="store_true", help="engines hold BF16, not FP8")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per host")
    g.add_argument("--nic-gb-per-s", type=float, help="one NIC's GB/s (400 Gb/s = 50)")
    g.add_argument("--nics-per-gpu", type=int, help="NICs per GPU")
    g.add_argument("--nvlink-gb-per-s", type=float, help="per-GPU NVLink GB/s")
    g.add_argument(
        "--gather-fp8",
        action="store_true",
        help="gather every FP8 unit that spans trainer ranks, even where the shards split it "
        "on block rows (PlannerConfig.quantize_in_shards off)",
    )
    g.add_argument(
        "--memory-budget-gib",
        type=float,
        default=1.0,
        help="temporary memory per trainer rank (default 1)",
    )


def _preset(ns: argparse.Namespace) -> Any:
    from weight_transfer.planner.presets.clusters import get_preset, with_overrides

    mapping = {
        "trainer_gpus": "trainer.num_gpus",
        "dense_shard": "trainer.dense_shard_size",
        "expert_shard": "trainer.expert_shard_size",
        "offload": "trainer.offload",
        "engine_replicas": "engine.num_replicas",
        "engine_tp": "engine.tp",
        "engine_ep": "engine.ep",
        "gpus_per_node": "gpus_per_node",
        "nic_gb_per_s": "rates.nic_gb_per_s",
        "nics_per_gpu": "rates.nics_per_gpu",
        "nvlink_gb_per_s": "rates.nvlink_gb_per_s",
    }
    changes: dict[str, object] = {
        key: getattr(ns, attr) for attr, key in mapping.items() if getattr(ns, attr) is not None
    }
    if ns.engine_bf16:
        changes["engine.fp8"] = False
    preset = get_preset(ns.preset)
    if ns.trainer_gpus is not None:
        # Keep shard groups valid when only the size changes.
        for key in ("trainer.dense_shard_size", "trainer.expert_shard_size"):
            if key not in changes:
                old = getattr(preset.trainer, key.split(".")[1])
                changes[key] = old if ns.trainer_gpus % old == 0 else ns.trainer_gpus
    return with_overrides(preset, **changes)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _gb(n: float) -> str:
    """Bytes in the largest decimal unit that keeps them >= 1 (so small presets show too)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _rates(text: str, base: Any) -> Any:
    """`--rates`: inline JSON object, else a JSON file's path."""
    import json

    from weight_transfer.planner.simulate import load_rates, rates_from_mapping

    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--rates: not valid JSON: {exc}") from exc
        return rates_from_mapping(data, base)
    try:
        return load_rates(text, base)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--rates {text}: not valid JSON: {exc}") from exc


def _build(ns: argparse.Namespace) -> tuple[Any, Any, Any, Any, Any]:
    from weight_transfer.planner.plan import PlannerConfig, plan
    from weight_transfer.planner.presets.clusters import cluster_manifests

    preset = _preset(ns)
    config = PlannerConfig(
        memory_budget_bytes=int(ns.memory_budget_gib * 2**30), quantize_in_shards=not ns.gather_fp8
    )
    _progress(preset.describe())
    t0 = time.perf_counter()
    _progress("building manifests ...")
    sources, dests = cluster_manifests(preset)
    n = sum(len(m.tensors) for m in sources)
    _progress(
        f"planning ({len(sources)} trainer ranks, {n} shard entries, {len(dests)} engines) ..."
    )
    t1 = time.perf_counter()
    schedule = plan(sources, dests, config)
    _progress(f"planned in {time.perf_counter() - t1:.1f} s (manifests {t1 - t0:.1f} s)")
    return preset, config, sources, dests, schedule


def _plan_args(p: argparse.ArgumentParser) -> None:
    _cluster_args(p)
    p.add_argument("--json", dest="json_path", help="write the schedule's canonical JSON here")


def _plan(ns: argparse.Namespace) -> int:
    from weight_transfer.errors import WeightTransferError
    from weight_transfer.planner.plan import schedule_to_json

    try:
        preset, config, sources, dests, schedule = _build(ns)
    except (ValueError, WeightTransferError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tasks = [t for r in schedule.ranks for t in r.tasks]
    gathers = sum(1 for t in tasks if t.kind == "gather")
    per_rank = schedule.bytes_per_rank
    per_engine = schedule.bytes_per_engine
    temp = [t.staging_bytes + t.scratch_bytes for t in tasks]
    rows = [
        ("preset", preset.describe()),
        ("trainer ranks / engines", f"{schedule.num_ranks} / {len(schedule.engines)}"),
        ("mesh groups", str(schedule.num_mesh_groups)),
        ("tasks", f"{len(tasks)} ({gathers} gather, {len(tasks) - gathers} direct)"),
        ("writes", str(sum(len(t.writes) for t in tasks))),
        ("bytes written", _gb(sum(per_engine))),
        (
            "bytes per trainer rank",
            f"min {_gb(min(per_rank))} / median {_gb(statistics.median(per_rank))} / max "
            f"{_gb(max(per_rank))}",
        ),
        (
            "bytes per engine",
            f"min {_gb(min(per_engine))} / median {_gb(statistics.median(per_engine))} / max "
            f"{_gb(max(per_engine))}",
        ),
        (
            "temporary memory per task",
            f"max {_gb(max(temp, default=0))} (budget {_gb(config.memory_budget_bytes)})",
        ),
        ("fingerprint", schedule.fingerprint[:16]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if ns.json_path:
        _progress(f"writing {ns.json_path} ...")
        Path(ns.json_path).write_text(schedule_to_json(schedule))
        print(f"{'schedule JSON':<{width}}  {ns.json_path}")
    return 0


def _simulate_args(p: argparse.ArgumentParser) -> None:
    _cluster_args(p)
    p.add_argument(
        "--rates",
        metavar="JSON",
        help="measured rates over the preset's: a JSON file, or an inline JSON object "
        "of weight_transfer.planner.simulate.Rates fields, e.g. '{\"nic_gb_per_s\": 40}'",
    )
    p.add_argument(
        "--links",
        choices=["fifo", "fair"],
        default="fifo",
        help="link model: fifo (a batch holds each link alone; any scale) or fair "
        "(flows share links max-min fairly, as TCP does; small clusters only, "
        "docs/simulator.md)",
    )
    d = p.add_argument_group("delta updates (docs/delta.md)")
    d.add_argument(
        "--delta-density",
        type=float,
        metavar="X",
        help="also predict a delta update in which this fraction of the engine elements "
        "changed (BF16 tensors, and FP8 bytes unless --delta-density-fp8 is given); "
        "benchmarks/results/delta_density_* has measured values",
    )
    d.add_argument(
        "--delta-density-fp8", type=float, metavar="X", help="fraction of FP8 bytes changed"
    )
    d.add_argument(
        "--delta-scales",
        type=float,
        default=1.0,
        metavar="X",
        help="fraction of FP8 block scales changed (default 1: every scale is sent)",
    )


def _simulate(ns: argparse.Namespace) -> int:
    from weight_transfer.errors import WeightTransferError
    from weight_transfer.planner.delta import DeltaDensity
    from weight_transfer.planner.presets.clusters import model_bytes
    from weight_transfer.planner.simulate import broadcast_baseline, simulate

    try:
        # Bad rates and densities are refused before the planning starts.
        described = _preset(ns)
        rates = _rates(ns.rates, described.rates) if ns.rates else described.rates
        density = None
        if ns.delta_density is not None or ns.delta_density_fp8 is not None:
            other = ns.delta_density if ns.delta_density is not None else ns.delta_density_fp8
            fp8 = ns.delta_density_fp8 if ns.delta_density_fp8 is not None else other
            try:
                density = DeltaDensity(other=other, fp8=fp8, scales=ns.delta_scales)
            except ValueError as exc:
                raise ValueError(f"--delta-density: {exc}") from exc
        preset, config, sources, dests, schedule = _build(ns)
    except (ValueError, OSError, WeightTransferError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _progress("simulating ...")
    r = simulate(
        schedule,
        sources,
        {d.engine: d.host for d in dests},
        rates,
        memory_budget_bytes=config.memory_budget_bytes,
        progress=_progress,
        links=ns.links,
    )
    train_bytes, _ = model_bytes(preset)
    base = broadcast_baseline(
        train_bytes,
        list(schedule.bytes_per_engine),
        rates,
        fp8=preset.engine.fp8,
        trainer_single_host=preset.trainer.num_gpus <= preset.gpus_per_node,
    )
    labels = {
        "trainer_nic": "trainer NIC (busiest)",
        "engine_nic": "engine NIC (busiest)",
        "nvlink": "NVLink (busiest)",
        "h2d": "host-to-device (busiest)",
        "prepare": "prepare/quantize (busiest)",
    }
    print(preset.describe())
    print(
        f"rates: NIC {rates.nics_per_gpu} x {rates.nic_gb_per_s:g} GB/s, NVLink "
        f"{rates.nvlink_gb_per_s:g} GB/s, h2d {rates.h2d_gb_per_s:g} GB/s, prepare "
        f"{rates.prepare_gb_per_s:g} GB/s, quantize {rates.quantize_gb_per_s:g} GB/s, per write "
        f"{rates.write_overhead_s * 1e6:g} us, per task {rates.task_overhead_s * 1e6:g} us"
    )
    print()
    print(
        f"control plane: round trip {rates.control_rtt_s * 1e6:g} us, store "
        f"{rates.control_request_s * 1e6:g} us per request, controller "
        f"{rates.control_message_s * 1e6:g} us per rank report"
    )
    print()
    print(f"{'':<30}{'schedule':>12}{'rank-0 broadcast':>20}")
    print(f"{'predicted update':<30}{r.update_s:>11.3f}s{base.predicted_s:>19.3f}s")
    print(f"{'  data plane':<30}{r.predicted_s:>11.3f}s")
    print(f"{'  control plane':<30}{r.control_plane_s:>11.3f}s")
    print(f"{'lower bound (data plane)':<30}{r.lower_bound_s:>11.3f}s")
    print(f"{'efficiency (bound/data plane)':<30}{r.efficiency:>12.1%}")
    print(
        "(a prediction of the simulator's model from the rates above, not a measurement: "
        "docs/simulator.md compares it with measured updates)"
    )
    free = [
        name
        for name, value in (
            ("per write", rates.write_overhead_s),
            ("per task", rates.task_overhead_s),
        )
        if value == 0
    ]
    if free:
        print(
            f"note: this prediction counts no host cost {' and '.join(free)} (0 in these rates); "
            "real updates pay them: give measured ones with --rates"
        )
    print()
    print("stage bounds:")
    for k, v in r.stage_bound_s.items():
        mark = "  <- improve this" if k == r.bottleneck else ""
        print(f"  {labels[k]:<28}{v:>10.3f}s  {r.busiest[k]}{mark}")
    print(
        f"  {'baseline gather/bcast/load':<28}{base.gather_s:>10.3f}s / {base.broadcast_s:.3f}s"
        f" / {base.load_s:.3f}s ({base.num_buckets} buckets)"
    )
    print()
    print("balance (bytes per GPU's NICs):")
    for name, s in (("trainer send", r.trainer_nic_bytes), ("engine receive", r.engine_nic_bytes)):
        print(
            f"  {name:<16} min {_gb(s.min)}  median {_gb(s.median)}  max {_gb(s.max)}  "
            f"(max/mean {s.imbalance:.3f})"
        )
    print(
        f"tasks {r.num_tasks}, bytes written {_gb(r.total_write_bytes)}, peak temporary memory "
        f"per rank {_gb(r.peak_memory_bytes)}, longest admission stall {r.stall_s * 1e3:.1f} ms"
    )
    print(f"bottleneck: {labels[r.bottleneck]}")
    if density is not None:
        _progress("simulating the delta update ...")
        dr = simulate(
            schedule,
            sources,
            {d.engine: d.host for d in dests},
            rates,
            memory_budget_bytes=config.memory_budget_bytes,
            progress=_progress,
            links=ns.links,
            delta=density,
        )
        mode = "delta" if dr.predicted_s < r.predicted_s else "full (the delta is not faster)"
        print()
        print(
            f"delta update at densities {density.other:g} (BF16) / {density.fp8:g} (FP8 bytes) "
            f"/ {density.scales:g} (FP8 scales); diff {rates.diff_gb_per_s:g} GB/s, apply "
            f"{rates.apply_gb_per_s:g} GB/s"
        )
        print(f"{'':<30}{'full':>12}{'delta':>12}")
        # Both with the same control plane (delta mode's acknowledgements are not modelled).
        print(f"{'predicted update':<30}{r.update_s:>11.4f}s{dr.update_s:>11.4f}s")
        print(f"{'bytes written':<30}{_gb(r.total_write_bytes):>12}{_gb(dr.total_write_bytes):>12}")
        print(f"{'lower bound':<30}{r.lower_bound_s:>11.4f}s{dr.lower_bound_s:>11.4f}s")
        print(f"{'bottleneck':<30}{r.bottleneck:>12}{dr.bottleneck:>12}")
        print(f"{'engine apply (busiest)':<30}{'':>12}{dr.apply_s:>11.4f}s")
        print(f"{'snapshot advance (after)':<30}{'':>12}{dr.snapshot_advance_s:>11.4f}s")
        print("delta stage bounds:")
        for k, v in dr.stage_bound_s.items():
            print(f"  {labels[k]:<28}{v:>10.3f}s  {dr.busiest[k]}")
        print(f"decision: {mode}")
    return 0


COMMANDS = (
    Command(
        "plan",
        "plan a described cluster from manifests alone and summarise the schedule",
        _plan_args,
        _plan,
    ),
    Command(
        "simulate",
        "predict an update's time for a described cluster, beside the rank-0 broadcast",
        _simulate_args,
        _simulate,
    ),
)
