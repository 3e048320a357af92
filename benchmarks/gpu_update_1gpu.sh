#!/usr/bin/env bash
# One device call of the one-GPU update benchmarks (nvidia-h200): installs the carried wheels,
# makes `weight_transfer` importable from the checkout, optionally runs the GPU tests, then each
# named case of `bench update --layout one-gpu`, and merges every case's JSON into
# $OUT/update_1gpu.json (the device returns at most 8 files). Usage:
#   bash benchmarks/gpu_update_1gpu.sh [tests] CASE...
# CASE is NAME:PRESET:FP8(0|1):OFFLOAD(0|1):LAYERS:REPEATS:WARMUPS[:EXTRA ARGS with , for space]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/cases
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
rm -rf /tmp/wt && mkdir -p /tmp/wt/weight_transfer
cp transfer/_root/*.py /tmp/wt/weight_transfer/
for d in planner transfer backends; do ln -s "$PWD/$d" "/tmp/wt/weight_transfer/$d"; done
export PYTHONPATH=/tmp/wt:$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton, msgpack, cryptography; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/machine.txt"
if [ "${1:-}" = tests ]; then
  shift
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/unit/test_table_copy.py tests/integration/test_gpu_caller_stream.py ${WT_GPU_TESTS:-tests/unit/test_fp8_kernel.py} 2>&1 | tail -25 | tee "$OUT/tests.log"
fi
for c in "$@"; do
  IFS=: read -r name preset fp8 off layers rep warm extra <<<"$c"
  args=(--preset "$preset" --layout one-gpu --backend loopback --no-baseline --repeats "$rep" --warmups "$warm" --layers "$layers" --json "/tmp/cases/$name.json" --timeout-s 300)
  [ "$fp8" = 1 ] && args+=(--fp8)
  [ "$off" = 1 ] && args+=(--offload)
  [ -n "${extra:-}" ] && args+=(${extra//,/ })
  echo "== $name: ${args[*]}"
  timeout 330 python3 -m weight_transfer.benchmarks.bench_update "${args[@]}" > "/tmp/cases/$name.out" 2> "/tmp/cases/$name.err"
  echo "rc=$?"
  python3 - "$name" <<'PY'
import json, sys
n = sys.argv[1]
try:
    s = json.load(open(f"/tmp/cases/{n}.json"))["summary"]
except Exception as e:
    print(n, "no result:", e); print(open(f"/tmp/cases/{n}.err").read()[-2500:]); sys.exit()
u = s.get("update_s", {}); x = s.get("executor_s", {}); h = s.get("host", {})
print(f"{n}: update med {u.get('median',0)*1e3:.2f} ms [{u.get('min',0)*1e3:.2f}, {u.get('max',0)*1e3:.2f}] exec {x.get('median',0)*1e3:.2f} ceiling {s.get('ceiling_s',0)*1e3:.2f} ratio {s.get('ratio_to_ceiling')} h2d_ratio {s.get('ratio_to_h2d')} host/task {h.get('per_task_us')} us /write {h.get('per_write_us')} us tasks {h.get('num_tasks')} writes {h.get('num_writes')} verified {s.get('verified_updates')}/{s.get('updates')} {s.get('mismatches')[:3]}")
PY
done
python3 - <<'PY'
import glob, json, os
out = {}
for p in sorted(glob.glob("/tmp/cases/*.json")):
    if p.endswith(".trace.json"):
        continue
    d = json.load(open(p))
    d.get("trainer0", {}).pop("records", None)
    out[os.path.basename(p)[:-5]] = d
json.dump(out, open(os.path.join(os.environ["OUT"], "update_1gpu.json"), "w"), indent=1, default=str)
PY
tail -c 20000 /tmp/cases/*.err > "$OUT/stderr_tail.txt" 2>/dev/null
