"""pytest-benchmark suite: one-sided write throughput per backend and size, beside baselines.

Run: `pytest benchmarks/ --benchmark-json out.json` (options: `--transport-backends`,
`--transport-sizes`, `--transport-device cpu|cuda`, `--transport-rounds`). Each case checks the
written bytes bit for bit in the receiver before it is timed. The sender runs inside the test
process (pytest-benchmark times `WriteSampler.sample`); the receiver is a spawned process that
runs no code while writes land. `weight-transfer bench transports` measures the same cases with
both sides in spawned processes and writes a plot; see docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from benchmarks.conftest import MEASUREMENTS, bench_config
from weight_transfer.backends.availability import backend_unavailable_reason
from weight_transfer.benchmarks import transport_harness as harness


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    cfg = bench_config(metafunc.config)
    names = [(b, "baseline") for b in harness.BASELINES[cfg.device]]
    names += [(b, "backend") for b in cfg.backends]
    cases = [(name, kind, size) for name, kind in names for size in cfg.sizes_bytes]
    metafunc.parametrize("case", cases, ids=[f"{n}-{harness.format_size(s)}" for n, _, s in cases])


class _Sessions:
    """Receivers and senders opened on first use and closed at the end of the session."""

    def __init__(self, cfg: harness.BenchConfig) -> None:
        self.cfg = cfg
        self._pairs: dict[str, Any] = {}
        self._socket: tuple[harness.SocketReceiverProcess, harness.SocketSender] | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def backend(self, name: str) -> tuple[harness.ReceiverProcess, harness.WriteSampler]:
        if name not in self._pairs:
            cm = harness.backend_pair(self.cfg, name)
            self._pairs[name] = (cm, cm.__enter__())
        pair: tuple[harness.ReceiverProcess, harness.WriteSampler] = self._pairs[name][1]
        return pair

    def socket(self) -> harness.SocketSender:
        if self._socket is None:
            receiver = harness.SocketReceiverProcess(self.cfg.buffer_bytes, self.cfg.timeout_s)
            sender = harness.SocketSender(
                receiver.port, self.cfg.buffer_bytes, seed=self.cfg.seed,
                min_sample_bytes=self.cfg.min_sample_bytes, timeout_s=self.cfg.timeout_s,
            )  # fmt: skip
            self._socket = (receiver, sender)
        return self._socket[1]

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buffers is None:
            n = self.cfg.buffer_bytes
            if self.cfg.device == "cuda":
                self._buffers = (
                    torch.empty(n, dtype=torch.uint8, device="cuda:0"),
                    torch.empty(n, dtype=torch.uint8, device="cuda:1"),
                )
            else:
                self._buffers = (
                    torch.empty(n, dtype=torch.uint8),
                    torch.empty(n, dtype=torch.uint8),
                )
        return self._buffers

    def close(self) -> list[str]:
        problems: list[str] = []
        for cm, _ in self._pairs.values():
            try:
                cm.__exit__(None, None, None)
            except RuntimeError as exc:
                problems.append(str(exc))
        if self._socket is not None:
            receiver, sender = self._socket
            sender.close()
            problems += receiver.join()
        return problems


@pytest.fixture(scope="session")
def sessions(request: pytest.FixtureRequest) -> Iterator[_Sessions]:
    s = _Sessions(bench_config(request.config))
    yield s
    problems = s.close()
    assert not problems, problems


def _record(benchmark: Any, name: str, kind: str, size: int, k: int) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # benchmarks disabled: the case ran once, unmeasured
        return
    samples = tuple(float(t) for t in stats.stats.data)
    m = harness.Measurement(name, kind, size, k, samples)
    MEASUREMENTS.append(m)
    benchmark.extra_info.update(
        {
            "size_bytes": size,
            "ops_per_sample": k,
            "sample_bytes": m.sample_bytes,
            "median_gbps": m.median_gbps,
            "p10_gbps": m.p10_gbps,
            "p90_gbps": m.p90_gbps,
            "verified": True,
        }
    )


def test_write_throughput(benchmark: Any, case: tuple[str, str, int], sessions: _Sessions) -> None:
    """One backend or baseline at one message size: verify the bytes, then time samples."""
    name, kind, size = case
    cfg = sessions.cfg
    benchmark.group = harness.format_size(size)
    _, k = harness.sample_plan(size, cfg.min_sample_bytes)
    sample: Callable[[], float]
    if kind == "backend":
        reason = backend_unavailable_reason(name)
        if reason is not None:
            pytest.skip(reason)
        receiver, sampler = sessions.backend(name)
        span, seed = sampler.prepare(size)
        assert receiver.check(span, seed) == "ok"
        sample = sampler.sample
    elif name == "socket":
        sender = sessions.socket()
        sender.prepare(size)  # raises if the receiver saw different bytes
        sample = sender.sample
    elif name == "memcpy":
        torch.set_num_threads(cfg.memcpy_threads)
        sample = harness.memcpy_sampler(size, cfg.min_sample_bytes, cfg.seed, sessions.buffers())
    else:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < 2:
            pytest.skip(f"peer copy needs 2 CUDA GPUs, this host has {have}")
        sample = harness.peer_copy_sampler(size, cfg.min_sample_bytes, cfg.seed, sessions.buffers())
    benchmark.pedantic(sample, rounds=cfg.rounds, warmup_rounds=cfg.warmup_rounds, iterations=1)
    _record(benchmark, name, kind, size, k)
