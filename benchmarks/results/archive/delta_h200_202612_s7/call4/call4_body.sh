#!/usr/bin/env bash
# nvidia-h200 call 4 of s7: after the mapped advance, the snapshot in pinned host memory (`--delta-snapshot host`, what
# `snapshot_memory="auto"` with no device budget picks on a GPU), never run on a GPU before,
# the working tree (main + Snapshot.advance through mapped addresses).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R
export PYTHONPATH=$PWD/.whl/site
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
free -g > $R/free.txt
python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee $R/versions.txt
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_patch.py > $R/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $R/tests.log
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 7 --delta-anchor 2 --timeout-s 120)
for c in "llama_bf16_host:--preset llama-3.1-8b --delta-density 0.0078 --delta-snapshot host" "qwen3_bf16_host:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078 --delta-snapshot host" "llama_fp8_host:--preset llama-3.1-8b --fp8 --delta-density 0.0078 --delta-snapshot host"; do
  name=${c%%:*}; args=${c#*:}
  timeout 130 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --json $R/delta_$name.json > $R/delta_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s"
  python3 -c "import json; s=json.load(open('$R/delta_$name.json'))['summary']; d=s['delta']; print(json.dumps({'verified': s['verified'], **{k: d.get(k) for k in ('full_s','delta_s','encode_s','engine_apply_s','delta_over_full','snapshot_bytes','snapshot_device')}}))" || tail -5 $R/delta_$name.log
done
