"""The generic receiver's serving gate: no request is served from a model that never existed.

A sender in this process writes into a `WeightReceiver` (loopback); a failure is injected in
the middle of an update, after part of its writes landed. The engine's tensors then mix update
1 with the weights it started with (checked: some bytes new, some old), while its version word
still reads 0. The gate must say so: FAILED, `check_serving` refuses, `wait_serving` does not
return; a following complete update opens it again, on exactly the trainer's tensors.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import pytest
import torch

from weight_transfer.backends.base import WeightTransferError, WriteOp
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import (
    ControlPlaneConfig,
    ReceiverConfig,
    SenderConfig,
    TransferConfig,
)
from weight_transfer.controller import Controller
from weight_transfer.errors import NotServingError, TransportTimeoutError, UpdateFailedError
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.recipes import identity
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender
from weight_transfer.serving import ServingGate, ServingState

SHAPES = {"a.weight": (96, 64), "b.weight": (64, 64), "c.weight": (128,)}


class Boom(Exception):
    """The injected failure (not one of ours)."""


def _half_then_fail(sender: WeightSender, armed: dict[str, Any]) -> None:
    """The first batch posted while armed writes only its first half of ops, then raises."""
    tr: Any = sender._transport
    real_post, real_prepared = tr.post_writes, tr.post_prepared

    def fail_after_half(peer: str, ops: list[WriteOp]) -> None:
        armed["on"] = False
        tr.wait(real_post(peer, list(ops[: max(1, len(ops) // 2)])), 10)
        armed["t_fail"] = time.monotonic()
        raise Boom(f"injected after {max(1, len(ops) // 2)} of {len(ops)} writes to {peer}")

    def post_writes(peer: str, ops: list[WriteOp]) -> Any:
        if armed["on"]:
            fail_after_half(peer, ops)
        return real_post(peer, ops)

    def post_prepared(prepared: Any) -> Any:
        if armed["on"]:
            fail_after_half(prepared.peer, list(prepared.ops))
        return real_prepared(prepared)

    tr.post_writes, tr.post_prepared = post_writes, post_prepared


@pytest.mark.timeout(120)
def test_a_failed_update_closes_the_gate_until_a_complete_one_lands() -> None:
    g = torch.Generator().manual_seed(5)
    start = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    live = {n: t.clone() for n, t in start.items()}
    src = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=20)
    config = TransferConfig(
        num_engines=1,
        control=cp,
        sender=SenderConfig(update_timeout_s=20),
        planner=PlannerConfig(memory_budget_bytes=1 << 20),
    )
    ctrl = Controller(config.controller_config(1), cp)
    rx = WeightReceiver(live, [identity(n, n, s) for n, s in SHAPES.items()], config, engine="e0")
    sender = WeightSender(src, config, controller=ctrl)
    armed: dict[str, Any] = {"on": True}
    _half_then_fail(sender, armed)
    try:
        assert rx.serving.state is ServingState.SERVING and rx.check_serving() == 0

        engine_error: list[BaseException] = []

        def engine() -> None:
            try:
                rx.wait_for_version(1, timeout_s=20)
            except BaseException as exc:  # the test checks it
                armed["t_engine"] = time.monotonic()
                engine_error.append(exc)

        th = threading.Thread(target=engine)
        th.start()
        with pytest.raises(WeightTransferError, match="injected after"):
            sender.update(1)
        th.join(30)
        assert not th.is_alive() and engine_error, "the engine did not hear of the failure"
        print(
            f"\nengine's gate FAILED {armed['t_engine'] - armed['t_fail']:.3f} s after the failure"
        )
        # The tensors hold a model that never existed: part update 1, part the start.
        flat_live = torch.cat([live[n].flatten() for n in SHAPES])
        flat_new = torch.cat([src[n].flatten() for n in SHAPES])
        flat_old = torch.cat([start[n].flatten() for n in SHAPES])
        assert bool((flat_live == flat_new).any()) and bool((flat_live == flat_old).any())
        assert rx.version == 0
        status = rx.serving
        assert status.state is ServingState.FAILED and status.step == 1 and status.version == 0
        assert "injected after" in status.reason
        with pytest.raises(NotServingError, match="update 1 failed"):
            rx.check_serving()
        with pytest.raises(TransportTimeoutError, match="not serving"):
            rx.wait_serving(0.2)

        # A thread that serves waits on the gate; the next complete update releases it.
        served: list[int] = []
        waiter = threading.Thread(target=lambda: served.append(rx.wait_serving(30)))
        waiter.start()
        for t in src.values():
            t.add_(1.0)
        th = threading.Thread(target=lambda: served.append(rx.wait_for_version(2, 20)))
        th.start()
        sender.update(2)
        th.join(30)
        waiter.join(30)
        assert sorted(served) == [2, 2]
        assert rx.serving.state is ServingState.SERVING and rx.check_serving() == 2
        for n in SHAPES:
            assert torch.equal(live[n], src[n]), n

        # An engine with post-processing keeps the gate closed until it is done.
        for t in src.values():
            t.mul_(0.5)
        rx.begin_update(3)
        assert rx.serving.state is ServingState.UPDATING
        th = threading.Thread(target=lambda: rx.wait_for_version(3, 20, serve=False))
        th.start()
        sender.update(3)
        th.join(30)
        assert rx.serving.state is ServingState.UPDATING
        with pytest.raises(ValueError, match="update 4 is not complete"):
            rx.end_update(4)
        rx.end_update(3)
        assert rx.check_serving() == 3

        # A wait that times out with nothing decided leaves the gate closed (UPDATING).
        with pytest.raises(TransportTimeoutError):
            rx.wait_for_version(4, timeout_s=0.2)
        assert rx.serving.state is ServingState.UPDATING and rx.serving.version == 3
    finally:
        sender.close()
        rx.close()
        ctrl.close(linger_s=0)


def test_gate_transitions() -> None:
    gate = ServingGate()
    assert gate.check() == 0
    gate.begin(1)
    with pytest.raises(NotServingError, match="update 1 being written"):
        gate.check()
    gate.reopen()  # nothing was written: back to the weights it served
    assert gate.check() == 0
    gate.begin(2)
    gate.fail(2, "peer lost")
    gate.begin(3)  # a later window does not make a failed gate look merely "updating"
    assert gate.status.state is ServingState.FAILED
    gate.reopen()  # nor does a window that wrote nothing
    with pytest.raises(NotServingError, match="update 2 failed.*peer lost"):
        gate.check()
    gate.commit(3)
    assert gate.check() == 3 and gate.status.reason == ""


def _windowed(update_timeout_s: float = 20.0) -> tuple[Any, ...]:
    """One engine with `ReceiverConfig.update_window`, one trainer rank, loopback."""
    g = torch.Generator().manual_seed(9)
    live = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    start = {n: t.clone() for n, t in live.items()}
    src = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=20)
    config = TransferConfig(
        num_engines=1,
        control=cp,
        sender=SenderConfig(update_timeout_s=update_timeout_s),
        receiver=ReceiverConfig(update_window=True),
        planner=PlannerConfig(memory_budget_bytes=1 << 20),
    )
    ctrl = Controller(config.controller_config(1), cp)
    rx = WeightReceiver(live, [identity(n, n, s) for n, s in SHAPES.items()], config, engine="e0")
    sender = WeightSender(src, config, controller=ctrl)
    return live, start, src, rx, sender


def _gate_at_every_post(sender: WeightSender, rx: WeightReceiver) -> list[Any]:
    """The engine's gate as each batch of writes is posted (before any of its bytes land)."""
    seen: list[Any] = []
    tr: Any = sender._transport
    real_post, real_prepared = tr.post_writes, tr.post_prepared

    def post_writes(peer: str, ops: list[WriteOp]) -> Any:
        seen.append(rx.serving)
        return real_post(peer, ops)

    def post_prepared(prepared: Any) -> Any:
        seen.append(rx.serving)
        return real_prepared(prepared)

    tr.post_writes, tr.post_prepared = post_writes, post_prepared
    return seen


@pytest.mark.timeout(60)
def test_with_update_windows_no_byte_lands_while_the_gate_is_open() -> None:
    # Issue 40, finding 3. The engine serves for a while after each update before it opens the
    # next window; the trainers update back to back. Every batch must be posted while the gate
    # is closed for that very update (without the handshake, updates 2 and 3 were written
    # while the gate read SERVING).
    live, _, src, rx, sender = _windowed()
    seen = _gate_at_every_post(sender, rx)
    served: list[int] = []

    def engine() -> None:
        for k in (1, 2, 3):
            served.append(rx.wait_for_version(k, 20))
            time.sleep(0.3)  # serving update k: the gate is open

    th = threading.Thread(target=engine)
    th.start()
    try:
        for k in (1, 2, 3):
            for t in src.values():
                t.mul_(-1.5)
            before = len(seen)
            sender.update(k)
            assert len(seen) > before, "the update posted nothing"
            states = [(s.state, s.step) for s in seen[before:]]
            assert states == [(ServingState.UPDATING, k)] * len(states), (k, states)
        th.join(30)
        assert served == [1, 2, 3]
        for n in SHAPES:
            assert torch.equal(live[n], src[n]), n
    finally:
        sender.close()
        rx.close()


@pytest.mark.timeout(60)
def test_an_engine_that_opens_no_window_fails_the_update_before_any_write() -> None:
    live, start, src, rx, sender = _windowed(update_timeout_s=1.0)
    seen = _gate_at_every_post(sender, rx)
    try:
        t0 = time.monotonic()
        with pytest.raises(
            UpdateFailedError,
            match=r"update 1 not started, nothing was written: engine\(s\) "
            r"\['e0'\] did not open an update window within 1.0 s",
        ):
            sender.update(1)
        assert time.monotonic() - t0 < 5
        assert seen == [] and rx.version == 0 and rx.check_serving() == 0
        for n in SHAPES:
            assert torch.equal(live[n], start[n]), n
        th = threading.Thread(target=lambda: rx.wait_for_version(2, 20))
        th.start()
        sender.update(2)
        th.join(30)
        assert rx.check_serving() == 2
        for n in SHAPES:
            assert torch.equal(live[n], src[n]), n
    finally:
        sender.close()
        rx.close()


@pytest.mark.timeout(60)
def test_every_trainer_rank_fails_fast_when_an_engine_opens_no_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two trainer ranks: the rank hosting the controller tells the other (go/<k> carries why).
    from tests.unit._inprocess import Cluster, Engine, fsdp_shards

    g = torch.Generator().manual_seed(12)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    engine = Engine(
        "e0",
        tuple(identity(n, n, s) for n, s in SHAPES.items()),
        {n: torch.randn(s, generator=g) for n, s in SHAPES.items()},
    )
    start = {n: t.clone() for n, t in engine.tensors.items()}
    with Cluster(
        monkeypatch,
        full,
        {n: fsdp_shards(s, 2) for n, s in SHAPES.items()},
        [engine],
        world=2,
        timeout_s=10.0,
        update_timeout_s=1.0,
        receiver=ReceiverConfig(update_window=True),
    ) as cluster:
        out = cluster.update(1)
        for r in (0, 1):
            exc = out.results[r]
            assert isinstance(exc, UpdateFailedError), exc
            assert "['e0'] did not open an update window" in str(exc), str(exc)
            assert out.seconds[r] < 5
        for n, t in engine.tensors.items():
            assert torch.equal(t, start[n]), n
        rx = cluster.receivers[0]
        th = threading.Thread(target=lambda: rx.wait_for_version(2, 20))
        th.start()
        out = cluster.update(2)
        th.join(30)
        assert not any(isinstance(v, BaseException) for v in out.results.values()), out.results
        for n, t in engine.tensors.items():
            assert torch.equal(t, full[n]), n
