#!/usr/bin/env bash
# The CPU runs of benchmarks/results/replicas_cpu-2core_202612.md, as they ran (repository root,
# the 2-core CPU machine, one at a time; OUT defaults to this folder). The H200 call is
# h200_call.sh (run as `bash .whl/call.sh` with the package copied into .whl/site, docs/gpu_runs.md).
set -euo pipefail
OUT=${OUT:-benchmarks/results/archive/replicas_202612}
echo '{"write_overhead_s": 2.61e-05, "task_overhead_s": 7.2e-05}' >"$OUT/h200_overheads.json"
python benchmarks/bench_planner.py --preset kimi-k2 --json "$OUT/planner_bands.json" >"$OUT/planner_bands.log" 2>&1
sim() {  # name, extra args...
    local name=$1; shift
    weight-transfer simulate --preset kimi-k2 "$@" 2>&1 | grep -v "simulating:" >"$OUT/simulate_$name.txt"
}
sim bands_lo --delta-density 0.0078 --delta-density-fp8 0.00071 &
sim bands_hi --delta-density 0.054 --delta-density-fp8 0.0058
wait
sim bands_lo_overheads --rates "$OUT/h200_overheads.json" --delta-density 0.0078 --delta-density-fp8 0.00071 &
sim bands_hi_overheads --rates "$OUT/h200_overheads.json" --delta-density 0.054 --delta-density-fp8 0.0058
wait
python "$OUT/planstats.py.txt"
weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --json "$OUT/emulate_fp8.json" >"$OUT/emulate_fp8.log" 2>&1
weight-transfer emulate --preset emu-dense --repeats 5 --delta-density 0.0078 --json "$OUT/emulate_dense_delta.json" >"$OUT/emulate_dense_delta.log" 2>&1
