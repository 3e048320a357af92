#!/usr/bin/env bash
# One nvidia-h200 call (third delta round): tests, kernel probe, whole updates, one profile.
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=/tmp/r3; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee $R/versions.txt
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py tests/unit/test_table_copy.py > $R/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head
timeout 120 python3 benchmarks/probes/gpu_delta_kernel_probe.py --gib 4 --densities 0.0078 0.054 --json $R/delta_kernel_probe.json > $R/probe.log 2>&1; echo "probe rc=$? $(( $(date +%s)-t0 ))s"; tail -c 1500 $R/probe.log
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 7 --delta-anchor 2 --timeout-s 120)
for c in "llama_bf16_lo:--preset llama-3.1-8b --delta-density 0.0078" "qwen3_bf16_lo:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078" "llama_fp8_lo:--preset llama-3.1-8b --fp8 --delta-density 0.0078" "llama_bf16_hi:--preset llama-3.1-8b --delta-density 0.054"; do
  name=${c%%:*}; args=${c#*:}
  timeout 110 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --json $R/delta_$name.json > $R/delta_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s"
  python3 -c "import json; s=json.load(open('$R/delta_$name.json'))['summary']; d=s['delta']; print(json.dumps({'verified': s['verified'], **{k: d.get(k) for k in ('full_s','delta_s','encode_s','engine_apply_s','delta_over_full','copy_s')}}))"
  tar czf $OUT/r3.tgz -C /tmp r3
done
mkdir -p $R/prof
timeout 100 python3 -m weight_transfer.benchmarks.bench_update --preset qwen3-30b-a3b --layers 20 --delta-density 0.0078 --layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 3 --delta-anchor 0 --timeout-s 90 --profile $R/prof/q --json $R/prof/d.json > $R/prof/d.log 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s"
tar czf $OUT/r3.tgz -C /tmp r3
