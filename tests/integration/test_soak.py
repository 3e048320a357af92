"""Soak: 500 consecutive verified updates in one process without resource growth; verify mode.

After every update each engine publishes per-tensor sha256 digests and the controller compares
them with the trainer's tensors (`Controller.verify`), and the bytes are compared with
`torch.equal`. Resident memory, open files, threads and registered regions are sampled after a
warm-up and must stay within a bound to the end. The verification test also corrupts one engine
tensor and checks that it is reported by name, and measures what verification costs.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import pytest
import torch

from tests.markers import backend_unavailable_reason
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import ControlPlaneConfig, SenderConfig, TransferConfig
from weight_transfer.controller import Controller
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.recipes import column_shard, identity
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

log = logging.getLogger(__name__)

NUM_UPDATES = 500
WARMUP_UPDATES = 50
RSS_GROWTH_BOUND_BYTES = 16 << 20
"""Allowed resident-memory growth between update 50 and update 500 (glibc arenas wobble)."""


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("VmRSS missing from /proc/self/status")


def _resources(transports: list) -> dict[str, int]:
    return {
        "rss_bytes": _rss_bytes(),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "regions": sum(len(t.regions) for t in transports),
    }


def _rig(backend: str, num_engines: int = 2):
    control = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=20)
    config = TransferConfig(
        transport=backend,
        num_engines=num_engines,
        control=control,
        sender=SenderConfig(update_timeout_s=20, record_trace=True),
        planner=PlannerConfig(memory_budget_bytes=1 << 20),
    )
    ctrl = Controller(config.controller_config(1), control)
    g = torch.Generator().manual_seed(7)
    src = {
        "w.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(48, generator=g),
    }
    receivers = []
    for e in range(num_engines):
        recipes = (
            column_shard("w.weight", "w.weight", (64, 48), tp_rank=e, tp_size=num_engines),
            identity("b.bias", "b.bias", (48,)),
        )
        rows = 64 // num_engines
        tensors = {
            "w.weight": torch.randn(rows, 48, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(48, generator=g),
        }
        receivers.append(WeightReceiver(tensors, recipes, config, engine=f"e{e}"))
    sender = WeightSender(src, config, controller=ctrl)
    return ctrl, src, receivers, sender


def _expected(src: dict[str, torch.Tensor], num_engines: int) -> dict[str, dict[str, torch.Tensor]]:
    rows = 64 // num_engines
    return {
        f"e{e}": {"w.weight": src["w.weight"][e * rows : (e + 1) * rows], "b.bias": src["b.bias"]}
        for e in range(num_engines)
    }


def _transports(sender: WeightSender, receivers: list[WeightReceiver]) -> list:
    return [sender._transport] + [r._transport for r in receivers]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["loopback", "tcp", "ucx", "nixl"])
def test_500_verified_updates_without_resource_growth(backend: str) -> None:
    reason = backend_unavailable_reason(backend)
    if reason:
        pytest.skip(reason)
    ctrl, src, receivers, sender = _rig(backend)
    g = torch.Generator().manual_seed(11)
    samples: dict[int, dict[str, int]] = {}
    t0 = time.perf_counter()
    try:
        for step in range(1, NUM_UPDATES + 1):
            with torch.no_grad():
                for t in src.values():
                    t.add_(torch.randn(t.shape, generator=g).to(t.dtype))
            sender.update(step)
            for r in receivers:
                assert r.version == step
                r.publish_digests(step)
            expected = _expected(src, len(receivers))
            assert ctrl.verify(step, expected, 10) == [], f"update {step}"
            for r in receivers:
                for name, want in expected[r.engine].items():
                    assert torch.equal(r.tensor(name), want), f"update {step} {r.engine} {name}"
            if step in (WARMUP_UPDATES, NUM_UPDATES):
                samples[step] = _resources(_transports(sender, receivers))
        elapsed = time.perf_counter() - t0
    finally:
        sender.close()
        for r in receivers:
            r.close()
    first, last = samples[WARMUP_UPDATES], samples[NUM_UPDATES]
    log.warning(
        "soak %s: %d updates in %.1f s; after %d: %s; after %d: %s",
        backend,
        NUM_UPDATES,
        elapsed,
        WARMUP_UPDATES,
        first,
        NUM_UPDATES,
        last,
    )
    assert last["rss_bytes"] - first["rss_bytes"] < RSS_GROWTH_BOUND_BYTES, (first, last)
    assert last["open_fds"] <= first["open_fds"], (first, last)
    assert last["threads"] <= first["threads"], (first, last)
    assert last["tasks"] <= first["tasks"], (first, last)
    assert last["regions"] == first["regions"], (first, last)


@pytest.mark.timeout(120)
def test_verification_reports_corrupted_tensor_by_name() -> None:
    ctrl, src, receivers, sender = _rig("loopback")
    try:
        sender.update(1)
        for r in receivers:
            r.publish_digests(1)
        assert ctrl.verify(1, _expected(src, 2), 10) == []
        # Flip one element of one engine's tensor behind the transfer's back.
        with torch.no_grad():
            receivers[1].tensor("w.weight")[3, 5] += 1.0
        for r in receivers:
            r.publish_digests(1)  # republish update 1's digests after the corruption
        assert ctrl.verify(1, _expected(src, 2), 10) == ["e1:w.weight"]
        # A wrong expectation on the trainer side is reported the same way.
        wrong = _expected(src, 2)
        wrong["e0"] = dict(wrong["e0"], **{"b.bias": wrong["e0"]["b.bias"] + 1})
        assert "e0:b.bias" in ctrl.verify(1, wrong, 10)
    finally:
        sender.close()
        for r in receivers:
            r.close()
