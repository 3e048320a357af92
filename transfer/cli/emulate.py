"""`weight-transfer emulate`: a cluster preset as network namespaces with shaped links, real
updates over tcp/ucx, measured beside the simulator (`benchmarks/emulate.py`, docs/simulator.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from weight_transfer.cli.command import Command


def _emulate_args(p: argparse.ArgumentParser) -> None:
    from weight_transfer.cli.plan import _cluster_args

    _cluster_args(p)
    p.set_defaults(preset="emu-dense", memory_budget_gib=1 / 16)
    g = p.add_argument_group("emulation")
    g.add_argument(
        "--backend",
        default="tcp",
        choices=["tcp", "ucx"],
        help="data plane (ucx is forced onto its tcp lane over each host's link)",
    )
    g.add_argument(
        "--rate-mb",
        type=float,
        default=20.0,
        help="tbf rate of every host link, each way, in 10^6 bytes/s (default 20)",
    )
    g.add_argument("--delay-ms", type=float, default=0.0, help="netem delay per link end")
    g.add_argument(
        "--queue-ms",
        type=float,
        default=200.0,
        help="tbf queue per link end, in ms at the rate (default 200)",
    )
    g.add_argument("--warmups", type=int, default=1, help="verified updates not timed")
    g.add_argument("--repeats", type=int, default=3, help="timed, verified updates")
    g.add_argument(
        "--baseline",
        action="store_true",
        help="also run the rank-0 funnel (one FSDP mesh, no experts)",
    )
    g.add_argument("--baseline-repeats", type=int, default=2, help="timed funnel updates")
    g.add_argument("--bucket-bytes", type=int, default=1 << 20, help="funnel bucket size")
    g.add_argument("--timeout-s", type=float, default=600.0, help="limit of the whole run")
    g.add_argument(
        "--cpu-share",
        type=float,
        default=None,
        help="fraction of a core each emulated host's copy/quantize stages get in the "
        "simulator (default: this machine's cores / trainer ranks, at most 1)",
    )
    g.add_argument(
        "--delta-density",
        type=float,
        default=0.0,
        help="delta updates: flip the lowest bit of this fraction of the trainer's elements per "
        "update; the timed updates are deltas, predicted as such (docs/delta.md)",
    )
    g.add_argument("--json", dest="json_path", help="write the whole result here")


def _line(r: dict[str, Any]) -> list[str]:
    s, sim = r["measured_s"], r["simulated"] or {}
    out = [
        r["describe"],
        f"link: tbf {r['link']['tbf_mbyte_per_s']:g} MB/s, delay {r['link']['delay_ms']:g} ms; "
        f"ceiling (plain socket) {r['ceiling']['mbyte_per_s']:.2f} MB/s, rtt "
        f"{r['ceiling']['rtt_s'] * 1e3:.3f} ms",
        f"updates ({r['backend']}): min {s.get('min', 0):.3f} / median {s.get('median', 0):.3f} / "
        f"max {s.get('max', 0):.3f} s; all verified: {r['all_verified']}",
        f"simulator (fair links): {sim.get('predicted_s', 0):.3f} s, fifo links "
        f"{sim.get('predicted_fifo_s', 0):.3f} s, bound {sim.get('lower_bound_s', 0):.3f} s "
        f"({sim.get('bottleneck', '-')}); measured/predicted "
        f"{r['ratio_measured_over_predicted'] or 0:.3f}",
    ]
    if "delta" in r:
        d = r["delta"]
        out.append(
            f"delta at density {d['density']:g}: modes {d['modes']}, wire "
            f"{d['wire_fraction'].get('median', 0):.2%} of full; simulator delta "
            f"{d['predicted_delta_s'] or 0:.3f} s (full {d['predicted_full_s'] or 0:.3f} s); "
            f"measured/predicted {d['ratio_measured_over_predicted_delta'] or 0:.3f}"
        )
    if "funnel" in r:
        f = r["funnel"]
        out.append(
            f"rank-0 funnel: median {f['measured_s'].get('median', 0):.3f} s, predicted "
            f"{f['predicted_s']:.3f} s (gather {f['gather_s']:.3f} + broadcast "
            f"{f['broadcast_s']:.3f} + load), measured/predicted "
            f"{f['ratio_measured_over_predicted'] or 0:.3f}"
        )
    cpu = r["cpu_per_process"]
    if cpu:
        worst = max(cpu, key=lambda k: cpu[k]["cpu_fraction"])
        out.append(
            f"CPU per process during timed updates: max {cpu[worst]['cpu_fraction']:.0%} "
            f"of a core ({worst}); load average {r['loadavg_after'][0]:.2f}"
        )
    return out


def _emulate(ns: argparse.Namespace) -> int:
    from weight_transfer.benchmarks.emulate import EmulateConfig, run
    from weight_transfer.benchmarks.netns import unavailable_reason
    from weight_transfer.cli.plan import _preset

    reason = unavailable_reason()
    if reason:
        print(f"error: emulate {reason}", file=sys.stderr)
        return 2
    try:
        preset = _preset(ns)
        cfg = EmulateConfig(
            preset=preset,
            backend=ns.backend,
            rate_mbyte_per_s=ns.rate_mb,
            delay_ms=ns.delay_ms,
            queue_ms=ns.queue_ms,
            warmups=ns.warmups,
            repeats=ns.repeats,
            baseline=ns.baseline,
            baseline_repeats=ns.baseline_repeats,
            bucket_bytes=ns.bucket_bytes,
            memory_budget_bytes=int(ns.memory_budget_gib * 2**30),
            timeout_s=ns.timeout_s,
            cpu_share=ns.cpu_share,
            delta_density=ns.delta_density,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = run(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    result["command"] = "weight-transfer emulate " + " ".join(sys.argv[2:])
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps(result, indent=1) + "\n")
    for line in _line(result):
        print(line)
    for e in result["errors"]:
        print(f"error: {e.splitlines()[-1] if e.strip() else e}", file=sys.stderr)
    return 0 if result["all_verified"] and not result["errors"] else 1


COMMANDS = (
    Command(
        "emulate",
        "emulate a cluster preset on this machine: namespaces, shaped links, real "
        "updates, measured against the simulator (root)",
        _emulate_args,
        _emulate,
    ),
)
