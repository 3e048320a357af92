#!/usr/bin/env bash
# Delta updates on one H200 (issue 24), in one device call. NOT RUN YET (docs/gpu_runs.md).
# Installs the carried wheels (.whl/: msgpack, cryptography), makes `weight_transfer` importable
# from the checkout, then:
#   1. GPU tests: the delta kernels compiled (tests/unit/test_delta_kernels.py, CUDA cases) and
#      the FP8 kernel suite;
#   2. benchmarks/gpu_delta_kernel_probe.py: diff/encode and apply bandwidth on 4 GiB of BF16
#      at the measured densities, against a device copy of the same bytes;
#   3. bench update --layout one-gpu --delta-density D for Llama-3.1-8B BF16 and FP8 and
#      Qwen3-30B-A3B BF16 (48 layers): full and delta updates alternate (--delta-anchor 2), every
#      update verified bit-exact by keyed digests; JSON per case.
# Densities: benchmarks/results/delta_density_cpu-2core_202612.md (median over RL steps, all
# tensors): BF16 lr 1e-6 0.78%, lr 1e-5 5.4% (the defaults below).
# Usage (from the device tool): OUT=$OUT bash benchmarks/gpu_delta_1gpu.sh
set -u
OUT=${OUT:-/tmp/out}
DENSITY_LO=${DENSITY_LO:-0.0078}
DENSITY_HI=${DENSITY_HI:-0.054}
mkdir -p "$OUT" /tmp/cases
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# The package root is transfer/ with planner/, backends/, benchmarks/ as subpackages (pyproject).
rm -rf /tmp/wt && mkdir -p /tmp/wt/weight_transfer
for f in transfer/*; do ln -s "$PWD/$f" "/tmp/wt/weight_transfer/$(basename "$f")"; done
for d in planner backends benchmarks; do ln -s "$PWD/$d" "/tmp/wt/weight_transfer/$d"; done
export PYTHONPATH=/tmp/wt:$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py tests/unit/test_delta_patch.py 2>&1 | tail -15 | tee "$OUT/tests.log"
timeout 240 python3 benchmarks/gpu_delta_kernel_probe.py --gib 4 --densities "$DENSITY_LO" "$DENSITY_HI" 0.2 --json "$OUT/delta_kernel_probe.json" 2>&1 | tee "$OUT/probe.log"
for c in \
  "llama_bf16_lo:llama-3.1-8b::0:7:1:$DENSITY_LO" \
  "llama_bf16_hi:llama-3.1-8b::0:7:1:$DENSITY_HI" \
  "llama_fp8_lo:llama-3.1-8b:--fp8:0:7:1:$DENSITY_LO" \
  "qwen3_bf16_lo:qwen3-30b-a3b::48:7:1:$DENSITY_LO"; do
  IFS=: read -r name preset fp8 layers rep warm density <<<"$c"
  echo "== $name"
  timeout 330 python3 -m weight_transfer.benchmarks.bench_update --preset "$preset" $fp8 \
    --layout one-gpu --backend loopback --no-baseline --repeats "$rep" --warmups "$warm" \
    --layers "$layers" --delta-density "$density" --delta-anchor 2 --timeout-s 300 \
    --json "$OUT/delta_$name.json" > "/tmp/cases/$name.out" 2> "/tmp/cases/$name.err"
  echo "rc=$?"
  python3 - "$OUT/delta_$name.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["summary"]
except Exception as e:
    print("no result:", e); sys.exit()
d = s.get("delta", {})
f, x = d.get("full_s", {}), d.get("delta_s", {})
print(f"full {f.get('median', 0)*1e3:.2f} ms [{f.get('min', 0)*1e3:.2f}, {f.get('max', 0)*1e3:.2f}] "
      f"delta {x.get('median', 0)*1e3:.2f} ms [{x.get('min', 0)*1e3:.2f}, {x.get('max', 0)*1e3:.2f}] "
      f"delta/full {d.get('delta_over_full')} wire {d.get('wire_fraction')} apply {d.get('engine_apply_s')} "
      f"snapshot {d.get('snapshot_bytes')} on {d.get('snapshot_device')} ceiling {s.get('ceiling_s')} "
      f"verified {s.get('verified_updates')}/{s.get('updates')} {s.get('mismatches', [])[:3]}")
PY
done
tail -c 20000 /tmp/cases/*.err > "$OUT/stderr_tail.txt" 2>/dev/null
