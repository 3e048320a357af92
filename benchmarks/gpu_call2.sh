set -o pipefail
export OUT
bash benchmarks/gpu_update_1gpu.sh > $OUT/setup.txt 2>&1
export PYTHONPATH=/tmp/wt:$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/gpu_table_copy_probe.py $OUT/table_copy_probe.json 2>&1 | tee $OUT/probe.txt | tail -45
PICK=$(grep '^PICK=' $OUT/probe.txt | cut -d= -f2)
echo "picked $PICK"
bash benchmarks/gpu_update_1gpu.sh llama_fp8:llama-3.1-8b:1:0:0:7:2 dsv3_fp8:deepseek-v3-slice:1:0:0:5:1 llama_offload:llama-3.1-8b:0:1:0:5:1 qwen_fp8:qwen3-30b-a3b:1:0:48:5:1 2>&1 | grep -v "^==\|^rc=" | tee $OUT/log.txt
mv $OUT/update_1gpu.json $OUT/update_1gpu_a.json; rm -rf /tmp/cases
[ -n "$PICK" ] && WT_TABLE_COPY=$PICK bash benchmarks/gpu_update_1gpu.sh llama_bf16_tuned:llama-3.1-8b:0:0:0:7:2 qwen_bf16_tuned:qwen3-30b-a3b:0:0:48:5:1 2>&1 | grep -v "^==\|^rc=" | tee -a $OUT/log.txt
