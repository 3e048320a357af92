#!/usr/bin/env bash
# One nvidia-h200 call: the tile-parallel encode (tests, kernel probe).
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1
R=/tmp/r5; rm -rf $R; mkdir -p $R
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py > $R/tests.log 2>&1; rc=$?; echo "tests rc=$rc $(( $(date +%s)-t0 ))s"; tail -2 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head
tar czf $OUT/r5.tgz -C /tmp r5
[ $rc -eq 0 ] || exit 1
timeout 100 python3 benchmarks/probes/gpu_delta_kernel_probe.py --gib 4 --densities 0.0078 0.054 --json $R/delta_kernel_probe.json > $R/probe.log 2>&1; echo "probe rc=$? $(( $(date +%s)-t0 ))s"
python3 - <<'PY'
import json, statistics as st
d = json.load(open('/tmp/r5/delta_kernel_probe.json'))
for r in d['rows']:
    print(r['density'], 'copy ms', round(r['copy_s']*1e3, 3))
    for k in ('tables_one_run', 'tables_many_runs'):
        t = r[k]; print('  ', k, 'exact', t['bit_exact'], 'count', round(st.median(t['count_s'])*1e3, 3), 'count+encode', round(st.median(t['encode_s'])*1e3, 3), 'x', round(t['encode_vs_bound'], 3), 'apply', round(st.median(t['apply_s'])*1e3, 3))
PY
tar czf $OUT/r5.tgz -C /tmp r5
