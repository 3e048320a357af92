#!/usr/bin/env bash
# nvidia-h200, 2026-12-03: the GPU delta tests with the asynchronous encode handle, then whole
# one-GPU delta updates before (.whl/main_site: 2b3ee64) and after (.whl/site: the working tree
# with the change), alternating, every update verified by bench_update.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
t0=$(date +%s)
PYTHONPATH=$PWD/.whl/site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py tests/unit/test_delta_runtime.py tests/unit/test_replicas.py > $R/gpu_tests.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $R/gpu_tests.log
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 9 --delta-anchor 3 --timeout-s 120)
for c in "llama_bf16:--preset llama-3.1-8b --delta-density 0.0078 --delta-snapshot device" "qwen3_bf16:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078 --delta-snapshot device"; do
 for site in main_site site main_site site; do
  name=${c%%:*}; args=${c#*:}; k=${name}_${site}_$(( $(date +%s) % 1000 ))
  PYTHONPATH=$PWD/.whl/$site timeout 100 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --json $R/$k.json > $R/$k.log 2>&1
  echo "$k rc=$? $(( $(date +%s)-t0 ))s"
  python3 -c "import json; s=json.load(open('$R/$k.json'))['summary']; d=s['delta']; print(json.dumps({'verified': s['verified'], **{k: d.get(k) for k in ('full_s','delta_s','encode_s','engine_apply_s','delta_over_full')}}))" || tail -5 $R/$k.log
 done
done
