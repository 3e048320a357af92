"""Tables of emulated-cluster runs (`weight-transfer emulate --json`) from their JSON.

    python benchmarks/emulate_report.py benchmarks/results/emulate_cpu-2core_202612.json
    python benchmarks/emulate_report.py run1.json run2.json ...

Takes a published results file (one run per key of its `runs`) or the JSON files of single runs
(named after the file). Prints markdown: per run the measured update (min/median/max of the timed
updates on trainer rank 0), the simulator's prediction at the measured ceiling (fair and FIFO
link models), the ratio, the CPU use of the busiest process, and the rank-0 funnel where it ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _s(x: dict[str, float]) -> str:
    return f"{x['min']:.3f} / {x['median']:.3f} / {x['max']:.3f}" if x else "-"


def _runs(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if "runs" in data:  # a published results file: one run per key
            runs += [run | {"_name": name} for name, run in data["runs"].items()]
        else:
            runs.append(data | {"_name": Path(p).stem})
    return runs


def main(paths: list[str]) -> int:
    runs = _runs(paths)
    print(
        "| run | trainer -> engines | backend | ceiling MB/s | measured s (min / median / max) "
        "| predicted s (fair) | ratio | predicted s (FIFO) | ratio | bound (stage) | "
        "busiest CPU | verified |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        sim = r["simulated"] or {}
        cpu = r["cpu_per_process"]
        worst = max(cpu, key=lambda k: cpu[k]["cpu_fraction"]) if cpu else "-"
        e = r["describe"].split("-> ")[1].split(",")[0]
        name = r["_name"]
        print(
            f"| {name} | {r['trainer_ranks']} -> {e}) | {r['backend']} | "
            f"{r['ceiling']['mbyte_per_s']:.2f} | {_s(r['measured_s'])} | "
            f"{sim.get('predicted_s', 0):.3f} | {r['ratio_measured_over_predicted']:.3f} | "
            f"{sim.get('predicted_fifo_s', 0):.3f} | "
            f"{r['ratio_measured_over_predicted_fifo']:.3f} | "
            f"{sim.get('lower_bound_s', 0):.3f} ({sim.get('bottleneck', '-')}) | "
            f"{cpu[worst]['cpu_fraction']:.0%} ({worst}) | "
            f"{'yes' if r['all_verified'] else 'NO'} ({len(r['verified'])}) |"
        )
    fun = [r for r in runs if "funnel" in r]
    if fun:
        print()
        print(
            "| rank-0 funnel | trainer ranks | measured s (min / median / max) | predicted s | "
            "gather + broadcast + load s | ratio | ours median s | funnel / ours |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in sorted(fun, key=lambda r: r["trainer_ranks"]):
            f = r["funnel"]
            name = r["_name"]
        print(
            f"| {name} | {r['trainer_ranks']} | {_s(f['measured_s'])} | "
            f"{f['predicted_s']:.3f} | {f['gather_s']:.3f} + {f['broadcast_s']:.3f} + "
            f"{f['load_s']:.3f} | {f['ratio_measured_over_predicted']:.3f} | "
            f"{r['measured_s']['median']:.3f} | "
            f"{f['measured_s']['median'] / r['measured_s']['median']:.1f}x |"
        )
    print()
    print("| run | rates fed to the simulator | load average before / after | wall s |")
    print("|---|---|---|---|")
    for r in runs:
        rt = (r["simulated"] or {}).get("rates") or r["rates_fed_to_simulator"]
        probe = (r["simulated"] or {}).get("gather_probe_s")
        print(
            f"| {r['_name']} | NIC {rt['nic_gb_per_s'] * 1e3:.2f} MB/s, copy "
            f"{rt['prepare_gb_per_s']:.2f} GB/s, quantize {rt['quantize_gb_per_s'] * 1e3:.0f} "
            "MB/s, "
            f"collective latency {rt['collective_latency_s'] * 1e6:.0f} us"
            f"{' (gather probe)' if probe else ' (round trip)'}, write latency "
            f"{rt['write_latency_s'] * 1e6:.0f} us | "
            f"{r['loadavg_before'][0]:.2f} / {r['loadavg_after'][0]:.2f} | {r['wall_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
