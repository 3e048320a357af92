"""Measurement harnesses (`bench_update`, `transport_harness`), the network emulator (`emulate`,
`netns`) and the pytest-benchmark suite (`bench_*.py`); one-off probes in `probes`. Published
results (not installed) live in `benchmarks/results/`; see docs/benchmarks.md."""
