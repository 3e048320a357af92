#!/usr/bin/env bash
# One nvidia-h200 call (fourth delta round): the one-pass count+encode. Tests, probe, updates.
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=/tmp/r4; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee $R/versions.txt
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py > $R/tests.log 2>&1; rc=$?; echo "tests rc=$rc $(( $(date +%s)-t0 ))s"; tail -3 $R/tests.log; grep -E "^(FAILED|ERROR)|Error" $R/tests.log | head -20
tar czf $OUT/r4.tgz -C /tmp r4
[ $rc -eq 0 ] || exit 1
timeout 200 python3 benchmarks/probes/gpu_delta_kernel_probe.py --gib 4 --densities 0.0078 0.054 --json $R/delta_kernel_probe.json > $R/probe.log 2>&1; echo "probe rc=$? $(( $(date +%s)-t0 ))s"
python3 - <<'PY'
import json, statistics as st
d = json.load(open('/tmp/r4/delta_kernel_probe.json'))
for r in d['rows']:
    print(r['density'], 'copy ms', round(r['copy_s']*1e3, 3))
    for k in ('tables_one_run', 'tables_many_runs', 'tables_one_run_two_pass', 'tables_many_runs_two_pass'):
        t = r[k]; print('  ', k, 'exact', t['bit_exact'], 'count', round(st.median(t['count_s'])*1e3, 3), 'count+encode', round(st.median(t['encode_s'])*1e3, 3), 'x', round(t['encode_vs_bound'], 3), 'apply', round(st.median(t['apply_s'])*1e3, 3))
PY
tar czf $OUT/r4.tgz -C /tmp r4
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 7 --delta-anchor 2 --timeout-s 120)
for c in "llama_bf16_lo:--preset llama-3.1-8b --delta-density 0.0078" "qwen3_bf16_lo:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078" "llama_fp8_lo:--preset llama-3.1-8b --fp8 --delta-density 0.0078"; do
  name=${c%%:*}; args=${c#*:}
  timeout 110 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --json $R/delta_$name.json > $R/delta_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s"
  python3 -c "import json; s=json.load(open('$R/delta_$name.json'))['summary']; d=s['delta']; print(json.dumps({'verified': s['verified'], **{k: d.get(k) for k in ('full_s','delta_s','encode_s','engine_apply_s','delta_over_full')}}))"
  tar czf $OUT/r4.tgz -C /tmp r4
done
