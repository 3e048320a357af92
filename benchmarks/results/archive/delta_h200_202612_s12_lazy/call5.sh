#!/usr/bin/env bash
# nvidia-h200, 2026-12-04 (s12, call 5): the kept kernels, the probe with the scatter ceiling added (apply's bound),
# alone at the two measured densities.
set +e
export PYTHONPATH=$PWD/.whl/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.mem --format=csv | tee $OUT/gpu.txt
timeout 200 python3 benchmarks/probes/gpu_delta_cuda_probe.py --gib 4 --densities 0.0078 0.054 --rounds 2 --repeats 7 --sweep --json $OUT/cuda_probe.json 2>&1 | tail -30 | tee $OUT/probe.txt
