# 2026-12-01 session 2, call 11: the final code (call 9 plus per-phase timing of update()),
# GPU tests, then all six
# one-GPU cases (Qwen3 BF16 with a trace).
set -o pipefail
export OUT
mkdir -p "$OUT"
bash benchmarks/gpu_update_1gpu.sh tests llama_bf16:llama-3.1-8b:0:0:0:7:2 llama_fp8:llama-3.1-8b:1:0:0:7:2 qwen_bf16:qwen3-30b-a3b:0:0:48:5:1:--trace,/tmp/cases/qwen_bf16.trace.json qwen_fp8:qwen3-30b-a3b:1:0:48:5:1 dsv3_fp8:deepseek-v3-slice:1:0:0:5:1 llama_offload:llama-3.1-8b:0:1:0:5:1 2>&1 | grep -v "^rc=" | tee $OUT/log.txt
gzip -c /tmp/cases/qwen_bf16.trace.json > $OUT/qwen_bf16.trace.json.gz 2>/dev/null
