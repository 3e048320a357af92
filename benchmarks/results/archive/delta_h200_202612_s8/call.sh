#!/usr/bin/env bash
# nvidia-h200 call 2 of 2026-12-03 (evening): count of piece k+1 overlapping the encode of
# piece k (benchmarks/probes/gpu_delta_pipeline_probe.py), small then 4 GiB.
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
t0=$(date +%s)
timeout 120 python3 benchmarks/probes/gpu_delta_pipeline_probe.py --gib 0.25 --repeats 2 --pieces 1 2 4 --json $R/pipeline_small.json > $R/pipeline_small.log 2>&1
echo "small rc=$? $(( $(date +%s)-t0 ))s"; tail -6 $R/pipeline_small.log
timeout 300 python3 benchmarks/probes/gpu_delta_pipeline_probe.py --gib 4 --repeats 7 --pieces 1 2 4 8 16 --json $R/pipeline_4g.json > $R/pipeline_4g.log 2>&1
echo "4g rc=$? $(( $(date +%s)-t0 ))s"; tail -6 $R/pipeline_4g.log
