#!/usr/bin/env bash
# nvidia-h200, 2026-12-04: the kept CUDA C kernels (staging rows per element size): the GPU
# delta suites with "auto" (CUDA C) selected, then the probe against the Triton kernels.
set +e
export PYTHONPATH=$PWD/.whl/site
timeout 160 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py tests/unit/test_delta_runtime.py tests/unit/test_replicas.py 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 150 python3 benchmarks/probes/gpu_delta_cuda_probe.py --gib 4 --densities 0.0078 0.054 0.12 --rounds 2 --repeats 7 --sweep --json $OUT/cuda_probe.json 2>&1 | tail -30 | tee $OUT/probe.txt
