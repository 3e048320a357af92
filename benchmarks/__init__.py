"""Benchmark harnesses (`transport_harness`) and pytest-benchmark suites (`bench_*.py`)."""
