#!/usr/bin/env bash
# nvidia-h200, 2026-12-04 (s12, call 2): + lazy bitmap words, 16-byte staging writes in the count, pinned table copies;
# GPU delta suites ("auto" = CUDA C), the probe, then the host-work profile of one chunk.
set +e
export PYTHONPATH=$PWD/.whl/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.mem --format=csv | tee $OUT/gpu.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py tests/unit/test_delta_runtime.py tests/unit/test_replicas.py 2>&1 | tail -6 | tee $OUT/tests.txt
timeout 170 python3 benchmarks/probes/gpu_delta_cuda_probe.py --gib 4 --densities 0.0078 0.054 0.12 --rounds 2 --repeats 7 --sweep --json $OUT/cuda_probe.json 2>&1 | tail -30 | tee $OUT/probe.txt
timeout 90 python3 benchmarks/probes/gpu_delta_host_profile.py --calls 300 --top 30 > $OUT/host_profile.txt 2>&1; head -c 3000 $OUT/host_profile.txt
