#!/usr/bin/env bash
# The emulated-cluster runs of benchmarks/results/emulate_cpu-2core_202612.md (root; ~15 min on
# 2 cores). Each line is the exact command; results go to $OUT (default benchmarks/results).
set -u
OUT=${OUT:-benchmarks/results}
P=emulate_cpu-2core_202612
run() { echo "+ $*" >&2; "$@" || echo "exit $? : $*" >&2; }
run weight-transfer emulate --preset emu-dense --repeats 5 --baseline --baseline-repeats 3 --json "$OUT/${P}_dense_8x2tp2_tcp.json"
run weight-transfer emulate --preset emu-moe --repeats 5 --json "$OUT/${P}_moe_8x1ep4_tcp.json"
run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --json "$OUT/${P}_fp8_8x2tp2_tcp.json"
run weight-transfer emulate --preset emu-dense --trainer-gpus 4 --repeats 5 --baseline --baseline-repeats 3 --json "$OUT/${P}_dense_4x2tp2_tcp.json"
run weight-transfer emulate --preset emu-dense --trainer-gpus 2 --repeats 5 --baseline --baseline-repeats 3 --json "$OUT/${P}_dense_2x2tp2_tcp.json"
run weight-transfer emulate --preset emu-dense --backend ucx --repeats 5 --json "$OUT/${P}_dense_8x2tp2_ucx.json"
# Diagnostics of the gap: the same cluster at half the rate (a fixed overhead shrinks in ratio,
# a rate-proportional one does not) and with 1 ms of netem delay per link end.
run weight-transfer emulate --preset emu-dense --rate-mb 10 --repeats 5 --json "$OUT/${P}_dense_8x2tp2_tcp_10mb.json"
run weight-transfer emulate --preset emu-dense --delay-ms 1 --repeats 5 --json "$OUT/${P}_dense_8x2tp2_tcp_delay1ms.json"
# FP8 again once the fixed cost of one gather is measured in the run (`gather_probe_s`).
run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --json "$OUT/${P}_fp8_8x2tp2_tcp_probe.json"
# The 8-rank run again with the final code (the funnel model and the raw per-rank times).
run weight-transfer emulate --preset emu-dense --repeats 5 --baseline --baseline-repeats 3 --json "$OUT/${P}_dense_8x2tp2_tcp_final.json"
# FP8 with a 10 ms tbf queue instead of 200 ms: do the gathers' ring steps wait behind queued writes?
run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --queue-ms 10 --json "$OUT/${P}_fp8_8x2tp2_tcp_queue10ms.json"
run weight-transfer emulate --preset emu-dense --repeats 5 --baseline --baseline-repeats 3 --json "$OUT/${P}_dense_8x2tp2_tcp_final.json"
# FP8 with the per-task stage times of every rank in the result (`updates_raw`, `stages`).
run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --json "$OUT/${P}_fp8_8x2tp2_tcp_stages.json"
# FP8 at 10 MB/s: does the gap scale with the link (sharing) or stay fixed (per-collective cost)?
run weight-transfer emulate --preset emu-dense-fp8 --rate-mb 10 --repeats 5 --json "$OUT/${P}_fp8_8x2tp2_tcp_10mb.json"
# Second part of the session (FP8 gap): quiet machine; the last four with the CPU share
# (defaults to cores / trainer ranks since then; the first two ran before the option existed).
run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --json "$OUT/${P}_s2_fp8_8x2tp2_tcp_quiet.json"
run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --rate-mb 5 --json "$OUT/${P}_s2_fp8_8x2tp2_tcp_5mb_quiet.json"
for r in 20 10 5; do
  run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --rate-mb $r --json "$OUT/${P}_s2_fp8_8x2tp2_tcp_${r}mb_shared.json"
done
run weight-transfer emulate --preset emu-dense-fp8 --repeats 5 --rate-mb 20 --cpu-share 0.1667 --json "$OUT/${P}_s2_fp8_8x2tp2_tcp_20mb_share012.json"
# Delta updates (issue 24; benchmarks/results/emulate_delta_cpu-2core_202612.md): the measured
# median densities of BF16 weights per RL step at lr 1e-6 and 1e-5.
run weight-transfer emulate --preset emu-dense --delta-density 0.0078 --repeats 5 --json "$OUT/emulate_delta_cpu-2core_202612_lo.json"
run weight-transfer emulate --preset emu-dense --delta-density 0.054 --repeats 5 --json "$OUT/emulate_delta_cpu-2core_202612_hi.json"
