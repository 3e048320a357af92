"""pytest setup of the benchmark suites: collect `bench_*.py`, enable pytest-benchmark, options.

The repository's pytest configuration disables benchmarks (`--benchmark-disable` in addopts)
and collects only `tests/`, so the CI test run never runs these suites. `pytest benchmarks/`
enables them again unless `--benchmark-disable` is given on the command line itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from weight_transfer.benchmarks import transport_harness as harness  # noqa: E402

MEASUREMENTS: list[harness.Measurement] = []
"""Measurements of this session, for the ratio table printed at the end."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("weight-transfer transport benchmarks")
    group.addoption(
        "--transport-backends",
        default=",".join(harness.DEFAULT_BACKENDS),
        help="comma-separated backends (default: %(default)s)",
    )
    group.addoption(
        "--transport-sizes",
        default=None,
        help="comma-separated message sizes, e.g. 4KiB,1MiB,64MiB (default: per device)",
    )
    group.addoption("--transport-device", default="cpu", choices=sorted(harness.BASELINES))
    group.addoption("--transport-rounds", type=int, default=20, help="timed rounds per case")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Runs before pytest-benchmark builds its session from the options.
    if "--benchmark-disable" not in config.invocation_params.args:
        config.option.benchmark_enable = True


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        module: pytest.Module = pytest.Module.from_parent(parent, path=file_path)
        return module
    return None


def bench_config(config: pytest.Config) -> harness.BenchConfig:
    """The harness configuration from this session's command-line options."""
    device = config.getoption("--transport-device")
    sizes_opt = config.getoption("--transport-sizes")
    sizes = (
        tuple(harness.parse_size(s) for s in sizes_opt.split(",") if s.strip())
        if sizes_opt
        else (harness.DEFAULT_CUDA_SIZES if device == "cuda" else harness.DEFAULT_CPU_SIZES)
    )
    backends = tuple(b.strip() for b in config.getoption("--transport-backends").split(",") if b)
    return harness.BenchConfig(
        backends=backends,
        sizes_bytes=sizes,
        device=device,
        rounds=config.getoption("--transport-rounds"),
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not MEASUREMENTS:
        return
    result = harness.BenchResult(config=bench_config(config), host=harness.host_info())
    result.measurements = list(MEASUREMENTS)
    terminalreporter.section("transport throughput and ratios to baselines")
    terminalreporter.write_line(harness.format_table(result))
