"""Markdown table of the one-GPU update results from the stored JSON (no figure typed by hand).

    python benchmarks/update_results_table.py [benchmarks/results/update_h200_202612.json]
    [--readme]

Picks, per case, the last device call that measured it with the final code (`FINAL`), and
prints min / median / max of the whole `sender.update()` call, the executor time, the ceiling
of the same run, the ratios, host cost per task and per write, and how many updates verified.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FINAL = [
    ("Llama-3.1-8B BF16 -> BF16", "s2_call11", "llama_bf16", 1.15),
    ("Llama-3.1-8B BF16 -> FP8", "s2_call12", "llama_fp8", 1.3),
    ("Qwen3-30B-A3B BF16 -> BF16 (48 layers, all)", "s2_call11", "qwen_bf16", 1.15),
    ("Qwen3-30B-A3B BF16 -> FP8 (48 layers, all)", "s2_call12", "qwen_fp8", 1.3),
    ("DeepSeek-V3 slice BF16 -> FP8 (2 layers)", "s2_call11", "dsv3_fp8", 1.3),
    ("Llama-3.1-8B BF16, trainer CPU-offloaded", "s2_call11", "llama_offload", 1.05),
]


SAME_CODE = {  # other calls whose code times these cases the same way (docs/gpu_runs.md)
    name: ["s2_call9"] for name in ("llama_bf16", "qwen_bf16", "dsv3_fp8", "llama_offload")
}
# Call 12 changed only the FP8 graph groups' reallocation check (per parameter -> one list):
# for Llama FP8 (few, large parameters) calls 9 and 11 time the same work.
SAME_CODE["llama_fp8"] = ["s2_call11", "s2_call9"]
SAME_CODE["qwen_fp8"] = []


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _other(data: dict, call: str, name: str) -> str:
    case = data[call][name]
    s = case["summary"]
    u = s["update_s"]["median"]
    ratio = s["ratio_to_h2d"] if case["config"]["offload"] else s["ratio_to_ceiling"]
    return f"{call}: {_ms(u)} ms ({ratio:.2f}x, {s['verified_updates']}/{s['updates']} verified)"


def rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())["calls"]
    out = [
        "| case | bytes written | whole update ms, min / median / max | executor ms (median) | "
        "ceiling, same run (ms) | update / ceiling | executor / ceiling | target | host per task "
        "/ per write | verified | "
        "other runs, same code: whole update median (ratio) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, call, name, target in FINAL:
        s = data[call][name]["summary"]
        u, x = s["update_s"], s["executor_s"]
        if data[call][name]["config"]["offload"]:
            ceil = s["h2d_s"]["median"]
            what = f"pinned H2D {_ms(ceil)}"
        else:
            ceil = s["ceiling_s"]
            what = f"{_ms(ceil)} ({s['ceiling_formula']})"
        r, rx = u["median"] / ceil, x["median"] / ceil
        verdict = "met" if r <= target else "missed"
        h = s["host"]
        out.append(
            f"| {label} | {s['bytes_written'] / 1e9:.2f} GB | {_ms(u['min'])} / "
            f"**{_ms(u['median'])}** / "
            f"{_ms(u['max'])} | {_ms(x['median'])} | {what} | **{r:.2f}x** | {rx:.2f}x | "
            f"<= {target}x: {verdict} | {h['per_task_us']:.1f} us / {h['per_write_us']:.2f} us "
            f"({h['num_tasks']} tasks, {h['num_writes']} writes) | "
            f"{s['verified_updates']}/{s['updates']} | "
            + ", ".join(_other(data, c, name) for c in SAME_CODE.get(name, []))
            + " |"
        )
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = Path(args[0] if args else "benchmarks/results/update_h200_202612.json")
    print("\n".join(rows(path)))


if __name__ == "__main__":
    main()
