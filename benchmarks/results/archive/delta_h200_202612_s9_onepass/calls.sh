# The four device calls of the seventh kernel round (2026-12-03), each on a fresh or warm
# nvidia-h200, with the checkout's wheel under .whl/site (PYTHONPATH).
# call 1: the probe's first kernel (look-back one flag at a time with atomic reads)
python3 benchmarks/probes/gpu_delta_onepass_probe.py --check
python3 benchmarks/probes/gpu_delta_onepass_probe.py --gib 4 --json $OUT/onepass.json
# call 2: windowed look-back (32 flags per read, volatile loads)
python3 benchmarks/probes/gpu_delta_onepass_probe.py --check
python3 benchmarks/probes/gpu_delta_onepass_probe.py --gib 4 --json $OUT/onepass2.json
# call 3 (after vllm_h200.sh run .gpu/c3 delta-moe, same call)
python3 benchmarks/probes/gpu_delta_onepass_probe.py --gib 4 --tiles 2048 4096 --warps 4 \
    --orders pid --windows 32 128 --repeats 5 --json $OUT/onepass3.json
# call 4: ablations (1: no look-back, 2: no entry stores; timing only)
python3 benchmarks/probes/gpu_delta_onepass_probe.py --gib 4 --tiles 2048 4096 --warps 4 \
    --orders pid --windows 128 --ablate 0 1 2 --repeats 5 --json $OUT/onepass4.json
