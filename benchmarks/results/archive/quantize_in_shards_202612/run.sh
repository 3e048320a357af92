#!/usr/bin/env bash
# The runs of benchmarks/results/quantize_in_shards_202612.md, as they ran (repository root,
# the 2-core CPU machine; OUT defaults to this folder).
set -euo pipefail
OUT=${OUT:-benchmarks/results/archive/quantize_in_shards_202612}
echo '{"write_overhead_s": 2.61e-05, "task_overhead_s": 7.2e-05}' >"$OUT/h200_overheads.json"
# Planner, banded (default) and gathered, on a quiet machine, one after the other.
python benchmarks/bench_planner.py --preset kimi-k2 --json "$OUT/planner_bands.json" >"$OUT/planner_bands.log" 2>&1
python benchmarks/bench_planner.py --preset kimi-k2 --gather-fp8 --json "$OUT/planner_gathered.json" >"$OUT/planner_gathered.log" 2>&1
# Delta predictions: both plans, default rates and the H200-calibrated host overheads, the
# lr 1e-6 and lr 1e-5 densities (two at a time).
sim() {  # name, extra args...
    local name=$1; shift
    weight-transfer simulate --preset kimi-k2 "$@" 2>&1 | grep -v "simulating:" >"$OUT/simulate_$name.txt"
}
sim bands_lo --delta-density 0.0078 --delta-density-fp8 0.00071 &
sim bands_hi --delta-density 0.054 --delta-density-fp8 0.0058
wait
sim gathered_lo --gather-fp8 --delta-density 0.0078 --delta-density-fp8 0.00071 &
sim gathered_hi --gather-fp8 --delta-density 0.054 --delta-density-fp8 0.0058
wait
sim bands_lo_overheads --rates "$OUT/h200_overheads.json" --delta-density 0.0078 --delta-density-fp8 0.00071 &
sim bands_hi_overheads --rates "$OUT/h200_overheads.json" --delta-density 0.054 --delta-density-fp8 0.0058
wait
sim gathered_lo_overheads --gather-fp8 --rates "$OUT/h200_overheads.json" --delta-density 0.0078 --delta-density-fp8 0.00071 &
sim gathered_hi_overheads --gather-fp8 --rates "$OUT/h200_overheads.json" --delta-density 0.054 --delta-density-fp8 0.0058
wait
weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --json "$OUT/emulate_fp8_8x2tp2_tcp_bands.json" >"$OUT/emulate_fp8_8x2tp2_tcp_bands.log" 2>&1
