#!/usr/bin/env bash
# The nvidia-h200 calls behind vllm_h200_202612.md's delta-fp8 section, as they ran (three
# back-to-back calls of one warm machine each time, `bash benchmarks/vllm_h200.sh prepare`
# on the CPU machine first; `wheel` again before the second run, after the fix).
bash benchmarks/vllm_h200.sh stage .gpu/c1        # carry .gpu/c1
bash benchmarks/vllm_h200.sh stage .gpu/c2        # carry .gpu/c2
bash benchmarks/vllm_h200.sh run .gpu/c3 delta-fp8  # carry .gpu/c3 -> before_fix.* (at d830da1) / after_fix.*
