#!/usr/bin/env bash
# One nvidia-h200 call: the delta list of docs/gpu_runs.md ("Delta updates on one H200").
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $OUT/machine.txt
python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee $OUT/versions.txt
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -5 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
timeout 150 python3 benchmarks/probes/gpu_delta_kernel_probe.py --gib 4 --densities 0.0078 0.054 0.2 --json $OUT/delta_kernel_probe.json > $OUT/probe.log 2>&1; echo "probe rc=$? $(( $(date +%s)-t0 ))s"; tail -c 3000 $OUT/probe.log
D=(--layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 7 --delta-anchor 2 --timeout-s 120)
for c in "llama_bf16_lo:--preset llama-3.1-8b --delta-density 0.0078" "llama_bf16_hi:--preset llama-3.1-8b --delta-density 0.054" "llama_fp8_lo:--preset llama-3.1-8b --fp8 --delta-density 0.0078" "qwen3_bf16_lo:--preset qwen3-30b-a3b --layers 20 --delta-density 0.0078"; do
  name=${c%%:*}; args=${c#*:}
  timeout 110 python3 -m weight_transfer.benchmarks.bench_update $args "${D[@]}" --json $OUT/delta_$name.json > $OUT/delta_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s"; tail -c 1500 $OUT/delta_$name.log
done
timeout 100 python3 -m weight_transfer.benchmarks.bench_update --preset llama-3.1-8b --delta-density 0.0078 --layout one-gpu --backend loopback --no-baseline --warmups 1 --repeats 7 --delta-anchor 0 --delta-full-when-slower --timeout-s 120 --json $OUT/delta_llama_bf16_lo_guard.json > $OUT/delta_llama_bf16_lo_guard.log 2>&1
echo "guard rc=$? $(( $(date +%s)-t0 ))s"; python3 -c "import json; d=json.load(open('$OUT/delta_llama_bf16_lo_guard.json'))['summary']['delta']; print(json.dumps({k: d[k] for k in ('full_s','delta_s','modes')}))"
