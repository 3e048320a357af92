set -o pipefail
export OUT WT_GPU_TESTS=" "
bash benchmarks/gpu_update_1gpu.sh tests llama_bf16:llama-3.1-8b:0:0:0:7:2 llama_fp8:llama-3.1-8b:1:0:0:7:2 qwen_bf16:qwen3-30b-a3b:0:0:48:5:1:--trace,/tmp/cases/qwen_bf16.trace.json 2>&1 | grep -v "^rc=" | tee $OUT/log.txt
cp /tmp/cases/qwen_bf16.trace.json $OUT/ 2>/dev/null
