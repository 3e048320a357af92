"""The ucx backend's target-side progress (option `target_progress`): UCX's `tcp` lane emulates
puts with messages that the target's worker must progress, so a tcp-only pair completes writes
only while the target's progress thread runs.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.markers import requires_module
from weight_transfer.backends.base import (
    ConfigurationError,
    RegionRole,
    TransportConfig,
    TransportTimeoutError,
    WriteOp,
)

TCP_ONLY = (("TLS", "tcp"), ("NET_DEVICES", "lo"))


def _ucx(*options: tuple[str, str]) -> object:
    from weight_transfer.backends.ucx import UcxTransport

    return UcxTransport(TransportConfig(name="ucx", options=tuple(options)))


@pytest.mark.parametrize("value", ["", "yes", "AUTO", "1"])
def test_bad_target_progress_is_refused_by_name(value: str) -> None:
    from weight_transfer.backends.ucx import UcxTransport

    with pytest.raises(ConfigurationError, match="target_progress"):
        UcxTransport(TransportConfig(name="ucx", options=(("target_progress", value),)))


@requires_module("libucx")
def test_thread_starts_with_a_target_region_and_stops_on_close() -> None:
    from weight_transfer.backends.ucx import UcxTransport

    auto = UcxTransport(TransportConfig(name="ucx"))
    off = UcxTransport(TransportConfig(name="ucx", options=(("target_progress", "off"),)))
    on = UcxTransport(TransportConfig(name="ucx", options=(("target_progress", "on"),)))
    try:
        buf = torch.arange(4096, dtype=torch.uint8)
        assert auto._progress_thread is None  # no TARGET yet: nothing to progress for
        auto.register(buf, role=RegionRole.SOURCE)
        assert auto._progress_thread is None
        auto.register(buf, role=RegionRole.TARGET)
        off.register(buf, role=RegionRole.TARGET)
        threads = [auto._progress_thread, on._progress_thread]
        assert off._progress_thread is None
        assert all(t is not None and t.is_alive() for t in threads)
    finally:
        t0 = time.monotonic()
        for transport in (auto, off, on):
            transport.close()
        elapsed = time.monotonic() - t0
    assert not any(t is not None and t.is_alive() for t in threads)
    assert elapsed < 2.0, elapsed  # woken through the event fd, not by its 100 ms poll timeout


def _tcp_pair_write(target_progress: str, timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Write 3 MiB + 5 in odd pieces from one tcp-only ucx transport into another."""
    from weight_transfer.backends.ucx import UcxTransport

    opts = (*TCP_ONLY, ("target_progress", target_progress))
    rx = UcxTransport(TransportConfig(name="ucx", listen_host="127.0.0.1", options=opts))
    tx = UcxTransport(TransportConfig(name="ucx", listen_host="127.0.0.1", options=opts))
    try:
        gen = torch.Generator().manual_seed(41)
        n = (3 << 20) + 5
        target = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        source = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        tx.connect("rx", rx.endpoint())
        src = tx.register(source, role=RegionRole.SOURCE)
        cuts = [0, 1, 4099, 1 << 20, (2 << 20) + 7, n]
        ops = [WriteOp(src, a, desc, a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
        tx.wait(tx.post_writes("rx", ops), timeout_s=timeout_s)
        return target.clone(), source
    finally:
        tx.close()
        rx.close()


@requires_module("libucx")
def test_tcp_lane_completes_with_target_progress() -> None:
    target, source = _tcp_pair_write("auto", timeout_s=30)
    assert torch.equal(target, source)


@requires_module("libucx")
def test_tcp_lane_without_target_progress_times_out() -> None:
    """The target's worker never runs: the emulated puts cannot complete (this is what the
    progress thread fixes; if UCX ever completed them alone, this test says so)."""
    with pytest.raises(TransportTimeoutError, match="'rx'"):
        _tcp_pair_write("off", timeout_s=1.5)
