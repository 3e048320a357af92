#!/usr/bin/env bash
# One nvidia-h200 call: GPU tests on this code, then one-GPU FP8 updates with this code ("new":
# local quantization units batched into tasks of about task_target_bytes) and with 95ea040
# ("old": one task per source set), alternating, in the same call. .whl/site: this code and its
# dependencies; .whl/old: weight_transfer at 95ea040 (docs/gpu_runs.md, "Getting the package there").
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=/tmp/qis; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
PYTHONPATH=$PWD/.whl/site python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee $R/versions.txt
t0=$(date +%s)
PYTHONPATH=$PWD/.whl/site timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_table_copy.py tests/unit/test_fp8_kernel.py tests/integration/test_gpu_reallocation.py tests/integration/test_gpu_caller_stream.py tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py tests/unit/test_plan.py tests/unit/test_staging_safety.py > $R/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head
B=(--layout one-gpu --backend loopback --no-baseline --fp8 --warmups 1 --repeats 5 --timeout-s 100)
for c in "llama:--preset llama-3.1-8b" "qwen3:--preset qwen3-30b-a3b"; do
  for v in new old; do
    name=${c%%:*}_$v; args=${c#*:}
    if [ $v = new ]; then PP=$PWD/.whl/site; else PP=$PWD/.whl/old:$PWD/.whl/site; fi
    PYTHONPATH=$PP timeout 150 python3 -m weight_transfer.benchmarks.bench_update $args "${B[@]}" --json $R/$name.json > $R/$name.log 2>&1
    echo "$name rc=$? $(( $(date +%s)-t0 ))s"; grep -E "whole update|verified|tasks" $R/$name.log | head -4
    tar czf $OUT/qis_gpu.tgz -C /tmp qis
  done
done
tar czf $OUT/qis_gpu.tgz -C /tmp qis
