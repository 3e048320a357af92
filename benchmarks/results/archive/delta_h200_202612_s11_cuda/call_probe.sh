set +e
export PYTHONPATH=$PWD/.whl/site
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py -k "cuda" -x 2>&1 | tail -5 | tee $OUT/tests.txt
timeout 360 python3 benchmarks/probes/gpu_delta_cuda_probe.py --gib 4 --densities 0.0078 0.054 0.12 --rounds 2 --repeats 7 --sweep --json $OUT/cuda_probe.json 2>&1 | tail -30 | tee $OUT/probe.txt
