#!/usr/bin/env bash
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 5 --delta-anchor 2 --timeout-s 60)
for c in "qwen3_bf16_lo:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078" "llama_bf16_lo:--preset llama-3.1-8b --delta-density 0.0078"; do
  name=${c%%:*}; args=${c#*:}
  timeout 80 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --json $OUT/d_$name.json > $OUT/d_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s"
  python3 -c "import json; s=json.load(open('$OUT/d_$name.json'))['summary']; d=s['delta']; print(json.dumps({'verified': s['verified'], **{k: d[k] for k in ('full_s','delta_s','encode_s','engine_apply_s','delta_over_full')}}))"
done
