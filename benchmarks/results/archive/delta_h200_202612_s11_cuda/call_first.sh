set +e
export PYTHONPATH=$PWD/.whl/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -c "import cupy; print('cupy', cupy.__version__)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_delta_kernels.py -k "cuda" -x 2>&1 | tail -30 | tee $OUT/tests.txt
timeout 300 python3 benchmarks/probes/gpu_delta_cuda_probe.py --gib 4 --densities 0.0078 0.054 --rounds 2 --repeats 7 --json $OUT/cuda_probe.json 2>&1 | tail -30 | tee $OUT/probe.txt
