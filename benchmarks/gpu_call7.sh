# 2026-12-01 session 2, call 7: the QuantTable kernel. GPU tests (FP8 kernel suite, table copy,
# caller-stream ordering), the quantize probe, then the FP8 cases (and Llama BF16 as a control).
set -o pipefail
export OUT
mkdir -p "$OUT"
bash benchmarks/gpu_update_1gpu.sh tests 2>&1 | tee $OUT/tests_log.txt
PYTHONPATH=/tmp/wt:$PWD:/tmp/site timeout 200 python3 benchmarks/gpu_quant_table_probe.py $OUT/quant_table_probe.json 2>&1 | tee $OUT/probe_log.txt
bash benchmarks/gpu_update_1gpu.sh llama_fp8:llama-3.1-8b:1:0:0:7:2 qwen_fp8:qwen3-30b-a3b:1:0:48:5:1 dsv3_fp8:deepseek-v3-slice:1:0:0:5:1 llama_bf16:llama-3.1-8b:0:0:0:7:2 2>&1 | grep -v "^rc=" | tee $OUT/log.txt
