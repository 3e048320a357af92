# 2026-12-01 session 2, call 10: QuantTable variants around the default (warps 16, stages).
set -o pipefail
export OUT
mkdir -p "$OUT"
bash benchmarks/gpu_update_1gpu.sh > /dev/null 2>&1
PYTHONPATH=/tmp/wt:$PWD:/tmp/site timeout 300 python3 benchmarks/gpu_quant_table_probe.py $OUT/quant_table_probe3.json 2>&1 | tee $OUT/probe_log.txt
