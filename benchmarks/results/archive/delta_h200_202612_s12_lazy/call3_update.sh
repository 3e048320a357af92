#!/usr/bin/env bash
# nvidia-h200, 2026-12-04 (s12, call 3): the kept kernels of call 2 (lazy bitmap words, 16-byte staged copies);
# whole one-GPU delta updates with --delta-kernels triton and cuda,
# alternating, every update verified by bench_update.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.whl/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
t0=$(date +%s)
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 9 --delta-anchor 3 --timeout-s 120 --delta-snapshot device)
for c in "llama_bf16:--preset llama-3.1-8b --delta-density 0.0078" "llama_bf16_5p4:--preset llama-3.1-8b --delta-density 0.054" "qwen3_bf16:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078"; do
 for kern in triton cuda triton cuda; do
  name=${c%%:*}; args=${c#*:}; k=${name}_${kern}_$(( $(date +%s) % 1000 ))
  timeout 110 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --delta-kernels $kern --json $R/$k.json > $R/$k.log 2>&1
  echo "$k rc=$? $(( $(date +%s)-t0 ))s"
  python3 -c "import json; s=json.load(open('$R/$k.json'))['summary']; d=s['delta']; print(json.dumps({'verified': s['verified'], **{k: d.get(k) for k in ('full_s','delta_s','encode_s','engine_apply_s','delta_over_full')}}))" || tail -5 $R/$k.log
  [ $(( $(date +%s)-t0 )) -gt 540 ] && { echo "stopping: time"; exit 0; }
 done
done
