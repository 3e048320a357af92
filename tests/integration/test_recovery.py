"""Recovery: a restarted engine rejoins and the trainers re-plan; replicas added and removed.

Runs the controller, sender and receivers in one process (a restart is a receiver closed and
a new one built on new memory, which is all a restarted engine process presents to the
trainers), on every backend that runs here. Every update is compared bit-exactly.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from tests.markers import backend_unavailable_reason
from weight_transfer.backends.base import (
    ConfigurationError,
    TransportTimeoutError,
    WeightTransferError,
)
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import (
    ControllerConfig,
    ControlPlaneConfig,
    SenderConfig,
    TransferConfig,
)
from weight_transfer.controller import Controller
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.recipes import column_shard, identity
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

SHAPE = (40, 24)


def backend_param(name: str):
    reason = backend_unavailable_reason(name)
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


BACKENDS = [backend_param(b) for b in ("loopback", "tcp", "ucx", "nixl")]


def _control(timeout_s: float = 15.0) -> ControlPlaneConfig:
    return ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=timeout_s)


def _config(cp: ControlPlaneConfig, backend: str) -> TransferConfig:
    return TransferConfig(
        transport=backend,
        control=cp,
        sender=SenderConfig(update_timeout_s=5),
        planner=PlannerConfig(memory_budget_bytes=1 << 20),
    )


def _engine(
    name: str,
    backend: str,
    cp: ControlPlaneConfig,
    *,
    tp_rank: int = 0,
    tp: int = 1,
    seed: int,
    rejoin: bool = False,
) -> WeightReceiver:
    g = torch.Generator().manual_seed(seed)
    rows = SHAPE[0] // tp
    recipes = (
        column_shard("w", "w", SHAPE, tp_rank=tp_rank, tp_size=tp)
        if tp > 1
        else identity("w", "w", SHAPE),
        identity("b", "b", (SHAPE[1],)),
    )
    tensors = {  # random fill, never what the trainer holds
        "w": torch.randn(rows, SHAPE[1], generator=g).to(torch.bfloat16),
        "b": torch.randn(SHAPE[1], generator=g),
    }
    return WeightReceiver(tensors, recipes, _config(cp, backend), engine=name, rejoin=rejoin)


def _step_weights(src: dict[str, torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for t in src.values():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype))


def _check(
    rx: WeightReceiver, src: dict[str, torch.Tensor], step: int, tp_rank: int = 0, tp: int = 1
) -> None:
    rows = SHAPE[0] // tp
    assert rx.version == step, (rx.engine, rx.version, step)
    assert torch.equal(rx.tensor("w"), src["w"][tp_rank * rows : (tp_rank + 1) * rows]), rx.engine
    assert torch.equal(rx.tensor("b"), src["b"]), rx.engine


def _trainer(cp: ControlPlaneConfig, ctrl: Controller, backend: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = {
        "w": torch.randn(SHAPE, generator=g).to(torch.bfloat16),
        "b": torch.randn(SHAPE[1], generator=g),
    }
    tx = WeightSender(src, _config(cp, backend), controller=ctrl)
    return src, tx


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_restarted_engine_rejoins_and_next_update_verifies(backend: str) -> None:
    cp = _control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=2), cp)
    e0 = _engine("e0", backend, cp, tp_rank=0, tp=2, seed=10)
    e1 = _engine("e1", backend, cp, tp_rank=1, tp=2, seed=11)
    src, tx = _trainer(cp, ctrl, backend)
    new_e1 = None
    try:
        _step_weights(src, 1)
        tx.update(1)
        _check(e0, src, 1, 0, 2)
        _check(e1, src, 1, 1, 2)
        regions_before = len(tx._transport.regions)
        e1.close()  # the engine process dies...
        new_e1 = _engine("e1", backend, cp, tp_rank=1, tp=2, seed=12, rejoin=True)  # ...restarts
        assert new_e1.version == 0
        if backend == "tcp":
            # Before re-planning the trainer still writes to the dead incarnation: refused,
            # named, and no engine advances.
            _step_weights(src, 2)
            with pytest.raises(WeightTransferError, match="e1"):
                tx.update(2)
            assert e0.version == 1 and new_e1.version == 0
        tx.replan(rejoined=["e1"])
        assert tx.epoch == 1 and ctrl.epoch == 1
        _step_weights(src, 3)
        tx.update(3)
        _check(e0, src, 3, 0, 2)
        _check(new_e1, src, 3, 1, 2)
        assert len(tx._transport.regions) == regions_before  # old plan's registrations released
    finally:
        tx.close()
        e0.close()
        if new_e1 is not None:
            new_e1.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_add_and_remove_engine_replica_between_updates(backend: str) -> None:
    cp = _control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    a = _engine("replicaA", backend, cp, seed=20)
    src, tx = _trainer(cp, ctrl, backend)
    b = None
    try:
        _step_weights(src, 1)
        tx.update(1)
        _check(a, src, 1)
        b = _engine("replicaB", backend, cp, seed=21)  # a new replica comes up
        tx.replan(engines=["replicaA", "replicaB"])
        _step_weights(src, 2)
        tx.update(2)
        _check(a, src, 2)
        _check(b, src, 2)
        tx.replan(engines=["replicaB"])  # replica A is taken away
        a_after = {n: a.tensor(n).clone() for n in ("w", "b")}
        a.close()
        _step_weights(src, 3)
        tx.update(3)
        _check(b, src, 3)
        assert a.version == 2 and all(torch.equal(a.tensor(n), a_after[n]) for n in a_after)
        assert tx._transport.peers == ["replicaB"]
    finally:
        tx.close()
        a.close()
        if b is not None:
            b.close()


@pytest.mark.timeout(60)
def test_replan_without_the_rejoin_times_out_naming_the_engine_and_keeps_the_old_plan() -> None:
    cp = _control(timeout_s=2)
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    e0 = _engine("e0", "loopback", cp, seed=30)
    src, tx = _trainer(cp, ctrl, "loopback")
    try:
        with pytest.raises(TransportTimeoutError, match=r"\['e0'\] did not \(re\)join"):
            tx.replan(rejoined=["e0"])
        with pytest.raises(ValueError, match="not among the engines"):
            tx.replan(engines=["e0"], rejoined=["e9"])
        _step_weights(src, 1)
        tx.update(1)  # still on the old plan
        _check(e0, src, 1)
        tx.replan()  # failed plans used up their numbers alike on both sides
        assert tx.epoch == ctrl.epoch == 3
        _step_weights(src, 2)
        tx.update(2)
        _check(e0, src, 2)
        with pytest.raises(ConfigurationError, match="never joined"):
            _engine("e7", "loopback", cp, seed=31, rejoin=True)
    finally:
        tx.close()
        e0.close()
