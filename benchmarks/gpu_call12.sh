# 2026-12-01 session 2, call 12: graph groups check their parameters' addresses as one list
# (was: a Python call per parameter before every replay, and no real check for graph sources).
# The new GPU reallocation test, then Llama FP8 and Qwen3 FP8 (with a trace).
set -o pipefail
export OUT
mkdir -p "$OUT"
WT_GPU_TESTS="tests/integration/test_gpu_reallocation.py" bash benchmarks/gpu_update_1gpu.sh tests llama_fp8:llama-3.1-8b:1:0:0:7:2 qwen_fp8:qwen3-30b-a3b:1:0:48:5:1:--trace,/tmp/cases/qwen_fp8.trace.json 2>&1 | grep -v "^rc=" | tee $OUT/log.txt
gzip -c /tmp/cases/qwen_fp8.trace.json > $OUT/qwen_fp8.trace.json.gz 2>/dev/null
