#!/usr/bin/env bash
# nvidia-h200 call 1 of 2026-12-03 (evening): engine replicas prepared once (bd49929, acf21cf).
# GPU tests (the new graph-group replica test among them), then one-GPU Llama-3.1-8B FP8 updates,
# full and delta, as regression checks of the graph path the change touched.
set -u
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/machine.txt
python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee $R/versions.txt
t0=$(date +%s)
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_replicas.py tests/integration/test_gpu_reallocation.py tests/integration/test_gpu_caller_stream.py tests/unit/test_table_copy.py tests/unit/test_fp8_kernel.py tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py > $R/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -4 $R/tests.log
D=(--layout one-gpu --backend loopback --no-baseline --timeout-s 100)
timeout 110 python3 -m weight_transfer.benchmarks.bench_update --preset llama-3.1-8b --fp8 "${D[@]}" --warmups 2 --repeats 7 --json $R/llama_fp8_full.json > $R/llama_fp8_full.log 2>&1
echo "full rc=$? $(( $(date +%s)-t0 ))s"
timeout 130 python3 -m weight_transfer.benchmarks.bench_update --preset llama-3.1-8b --fp8 "${D[@]}" --warmups 1 --repeats 7 --delta-density 0.0078 --delta-anchor 2 --delta-snapshot device --json $R/llama_fp8_delta.json > $R/llama_fp8_delta.log 2>&1
echo "delta rc=$? $(( $(date +%s)-t0 ))s"
for f in llama_fp8_full llama_fp8_delta; do
  python3 - $R/$f.json <<'PY' || tail -5 $R/$f.log
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(sys.argv[1].rsplit("/", 1)[-1], json.dumps({k: s.get(k) for k in ("verified", "verified_updates", "update_s", "ceiling_s", "ratio_to_ceiling")}), json.dumps({k: (s.get("delta") or {}).get(k) for k in ("full_s", "delta_s", "delta_over_full")}))
PY
done
