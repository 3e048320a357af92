"""One-off measurements behind the published results (`weight_transfer.benchmarks.probes`).

Each probe is a script: `python benchmarks/probes/NAME.py ...` or
`python -m weight_transfer.benchmarks.probes.NAME ...`; its docstring says what it measures and
which results file quotes it. The GPU probes need CUDA (docs/gpu_runs.md says how they ran).
"""
