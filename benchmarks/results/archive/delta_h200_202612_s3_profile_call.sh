#!/usr/bin/env bash
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 3 --delta-anchor 0 --timeout-s 90)
mkdir -p /tmp/prof
timeout 120 python3 -m weight_transfer.benchmarks.bench_update --preset qwen3-30b-a3b --layers 20 --delta-density 0.0078 "${D[@]}" --profile /tmp/prof/q --json /tmp/prof/d_qwen3.json > /tmp/prof/d_qwen3.log 2>&1
echo "qwen3 rc=$? $(( $(date +%s)-t0 ))s"
python3 -c "import json; d=json.load(open('/tmp/prof/d_qwen3.json')); print([(u['step'],u['mode'],round(u['update_s']*1e3,1), round(u['encode_s']*1e3,1), u['num_segments']) for u in d['trainer0']['delta_updates']], d['trainer0']['num_writes'], d['engine0']['apply_s'])"
tar czf $OUT/prof.tgz -C /tmp prof
