# 2026-12-01 session 2, call 13: loopback's in-process CUDA targets keyed by IPC handle and
# offset (call 12's new test found tensors of one allocator block overwriting each other).
set -o pipefail
export OUT
mkdir -p "$OUT"
WT_GPU_TESTS="tests/integration/test_gpu_reallocation.py" bash benchmarks/gpu_update_1gpu.sh tests 2>&1 | tee $OUT/log.txt
