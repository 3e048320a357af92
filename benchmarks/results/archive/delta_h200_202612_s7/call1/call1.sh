#!/usr/bin/env bash
# nvidia-h200 call 1 of s7: the library's staging count pass (no bitmap, int32 positions),
# GPU tests, the ablation of the s6 differences, the library's kernel probe beside main's,
# whole one-GPU delta updates.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R
export PYTHONPATH=$PWD/.whl/site
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee $R/versions.txt
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py tests/unit/test_table_copy.py > $R/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head
cp .whl/probe/fused_probe.py /tmp/fused_probe.py
timeout 150 python3 .whl/probe/ablate.py $R/ablate.json > $R/ablate.log 2>&1; echo "ablate rc=$? $(( $(date +%s)-t0 ))s"; cat $R/ablate.log | tail -25
summ() { python3 -c "
import json,statistics as st
d=json.load(open('$1'))
for r in d['rows']:
  for k in ('tables_one_run','tables_many_runs'):
    t=r[k]; print('  ',r['density'],k,t['runs'],'exact',t['bit_exact'],'count+encode %.3f ms (min %.3f max %.3f)'%(st.median(t['encode_s'])*1e3,min(t['encode_s'])*1e3,max(t['encode_s'])*1e3),'count %.3f ms'%(st.median(t['count_s'])*1e3),'vs bound %.2f'%t['encode_vs_bound'],'apply %.3f ms'%(st.median(t['apply_s'])*1e3))
  print('   copy %.3f ms'%(r['copy_s']*1e3))
"; }
for lib in main new; do
  if [ $lib = main ]; then P=$PWD/.whl/main_site; else P=$PWD/.whl/site; fi
  PYTHONPATH=$P timeout 120 python3 benchmarks/probes/gpu_delta_kernel_probe.py --gib 4 --densities 0.0078 0.054 0.12 --json $R/probe_$lib.json > $R/probe_$lib.log 2>&1; echo "probe $lib rc=$? $(( $(date +%s)-t0 ))s"; summ $R/probe_$lib.json
done
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 7 --delta-anchor 2 --timeout-s 120)
for c in "llama_bf16_lo:--preset llama-3.1-8b --delta-density 0.0078" "qwen3_bf16_lo:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078" "llama_fp8_lo:--preset llama-3.1-8b --fp8 --delta-density 0.0078"; do
  name=${c%%:*}; args=${c#*:}
  timeout 110 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --json $R/delta_$name.json > $R/delta_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s"
  python3 -c "import json; s=json.load(open('$R/delta_$name.json'))['summary']; d=s['delta']; print(json.dumps({'verified': s['verified'], **{k: d.get(k) for k in ('full_s','delta_s','encode_s','engine_apply_s','delta_over_full','copy_s')}}))"
done
cd $OUT && tar czf r.tgz r && rm -rf r
