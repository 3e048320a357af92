#!/usr/bin/env bash
# nvidia-h200, 2026-12-04 (s12, call 6): `weight-transfer doctor` on the GPU (its new delta
# kernels line), then with CuPy hidden (auto falls back to Triton), then kernels = "triton".
set +e
export PYTHONPATH=$PWD/.whl/site
python3 -c "from weight_transfer.cli import main; raise SystemExit(main(['doctor']))" 2>&1 | tail -4 | tee $OUT/doctor.txt
mkdir -p /tmp/nocupy && printf 'raise ImportError("hidden for this check")\n' > /tmp/nocupy/cupy.py
PYTHONPATH=/tmp/nocupy:$PWD/.whl/site python3 -c "from weight_transfer.cli import main; raise SystemExit(main(['doctor']))" 2>&1 | tail -1 | tee -a $OUT/doctor.txt
python3 -c "from weight_transfer.kernels import delta; delta.use_kernels('triton'); print(delta.kernels_report(0))" 2>&1 | tail -1 | tee -a $OUT/doctor.txt
