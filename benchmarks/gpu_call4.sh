set -o pipefail
export OUT
bash benchmarks/gpu_update_1gpu.sh qwen_bf16:qwen3-30b-a3b:0:0:48:5:1 llama_bf16:llama-3.1-8b:0:0:0:7:2 llama_offload:llama-3.1-8b:0:1:0:5:1 2>&1 | grep -v "^rc=" | tee $OUT/log.txt
