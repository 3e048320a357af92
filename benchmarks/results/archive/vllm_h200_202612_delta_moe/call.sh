# Three back-to-back calls of one warm nvidia-h200 (2026-12-03), the wheel of 293acfb
# (`bash benchmarks/vllm_h200.sh wheel` here first):
bash benchmarks/vllm_h200.sh stage .gpu/c1
bash benchmarks/vllm_h200.sh stage .gpu/c2
timeout 460 bash benchmarks/vllm_h200.sh run .gpu/c3 delta-moe > $OUT/delta_moe.log 2>&1
