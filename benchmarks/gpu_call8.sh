# 2026-12-01 session 2, call 8: QuantTable variants (two-pass sub-row kernel, warps).
set -o pipefail
export OUT
mkdir -p "$OUT"
bash benchmarks/gpu_update_1gpu.sh > /dev/null 2>&1
PYTHONPATH=/tmp/wt:$PWD:/tmp/site timeout 300 python3 benchmarks/gpu_quant_table_probe.py $OUT/quant_table_probe2.json 2>&1 | tee $OUT/probe_log.txt
