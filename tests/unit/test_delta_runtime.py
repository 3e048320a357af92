"""Delta updates through the real runtime in one process (controller, sender, receivers).

Oracle: what each engine tensor must hold is computed here by slicing the trainer tensors by
hand (tp shards of a fused qkv, a row-parallel o_proj, a fused gate_up quantized to FP8 with
the reference quantizer `planner.fp8`), never with the project's recipes. Every update is
compared bit for bit, deltas and full updates alike, over many steps of sparse changes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weight_transfer.backends.base import WeightTransferError
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import (
    ControlPlaneConfig,
    DeltaConfig,
    ReceiverConfig,
    SenderConfig,
    TransferConfig,
)
from weight_transfer.controller import Controller
from weight_transfer.delta import session as delta_sender
from weight_transfer.delta.patch import PatchError
from weight_transfer.delta.session import SpeedGuard
from weight_transfer.manifest import torch_dtype
from weight_transfer.planner.fp8 import quantize_fp8_blockwise
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.recipes import (
    engine_tensor_specs,
    fused_gate_up,
    fused_qkv,
    identity,
    row_shard,
    with_fp8,
)
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

H, HEADS, KV, HD, INTER, TP = 256, 4, 2, 64, 384, 2


def _trainer(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (HEADS * HD, H),
        "k": (KV * HD, H),
        "v": (KV * HD, H),
        "o": (H, HEADS * HD),
        "gate": (INTER, H),
        "up": (INTER, H),
        "norm": (H,),
    }
    return {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}


def _recipes(r: int) -> tuple[Any, ...]:
    return (
        fused_qkv(
            "qkv",
            "q",
            "k",
            "v",
            num_heads=HEADS,
            num_kv_heads=KV,
            head_dim=HD,
            trailing=(H,),
            tp_rank=r,
            tp_size=TP,
        ),
        row_shard("o_proj", "o", (H, HEADS * HD), tp_rank=r, tp_size=TP),
        with_fp8(fused_gate_up("gate_up", "gate", "up", shape=(INTER, H), tp_rank=r, tp_size=TP)),
        identity("norm", "norm", (H,)),
    )


def _expected(src: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """Engine rank r's tensors, by hand: vLLM's tp conventions (ANCHORS.md)."""
    qr, kr, ir = HEADS * HD // TP, KV * HD // TP, INTER // TP
    qkv = torch.cat(
        [
            src["q"][r * qr : (r + 1) * qr],
            src["k"][r * kr : (r + 1) * kr],
            src["v"][r * kr : (r + 1) * kr],
        ]
    )
    o = src["o"][:, r * (HEADS * HD // TP) : (r + 1) * (HEADS * HD // TP)]
    gate_up = torch.cat([src["gate"][r * ir : (r + 1) * ir], src["up"][r * ir : (r + 1) * ir]])
    q, s = quantize_fp8_blockwise(gate_up)
    return {"qkv": qkv, "o_proj": o, "gate_up": q, "gate_up_scale_inv": s, "norm": src["norm"]}


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def _perturb(src: dict[str, torch.Tensor], step: int, density: float) -> None:
    """An RL-like step: a fraction `density` of each tensor's elements moves by a few ulps."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for t in src.values():
            mask = torch.rand(t.shape, generator=g) < density
            t[mask] = (t[mask].float() * (1 + 0.02 * torch.randn(int(mask.sum()), generator=g))).to(
                t.dtype
            )


class Setup:
    def __init__(self, backend: str, delta: DeltaConfig, patch_bytes: int = 1 << 20) -> None:
        cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=20.0)
        config = TransferConfig(
            transport=backend,
            num_engines=TP,
            control=cp,
            sender=SenderConfig(update_timeout_s=20, delta=delta),
            receiver=ReceiverConfig(patch_region_bytes=patch_bytes),
            planner=PlannerConfig(memory_budget_bytes=1 << 20),
        )
        self.ctrl = Controller(config.controller_config(1), cp)
        self.engines: list[dict[str, torch.Tensor]] = []
        self.receivers: list[WeightReceiver] = []
        for r in range(TP):
            recipes = _recipes(r)
            g = torch.Generator().manual_seed(50 + r)
            tensors = {
                s.name: torch.randn(s.shape, generator=g).to(torch_dtype(s.dtype))
                for s in engine_tensor_specs(recipes)
            }
            self.engines.append(tensors)
            self.receivers.append(WeightReceiver(tensors, recipes, config, engine=f"e{r}"))
        self.src = _trainer(1)
        self.sender = WeightSender(self.src, config, controller=self.ctrl)

    def update(self, step: int) -> str:
        self.sender.update(step)
        for rx in self.receivers:
            rx.apply_delta(step, 20.0)
        assert self.sender.delta_stats is not None
        return self.sender.delta_stats.mode

    def check(self, src: dict[str, torch.Tensor] | None = None) -> None:
        for r, tensors in enumerate(self.engines):
            for name, want in _expected(src or self.src, r).items():
                assert _same(tensors[name], want), f"engine {r} {name}"

    def close(self) -> None:
        self.sender.close()
        for rx in self.receivers:
            rx.close()


@pytest.fixture(params=["loopback", "tcp"])
def setup(request: Any) -> Iterator[Setup]:
    s = Setup(
        request.param, DeltaConfig(enabled=True, anchor_every_updates=5, full_when_slower=False)
    )
    try:
        yield s
    finally:
        s.close()


@pytest.mark.timeout(180)
def test_bit_exact_over_many_steps_with_anchors(setup: Setup) -> None:
    modes = []
    for step in range(1, 14):
        _perturb(setup.src, step, 0.02)
        modes.append(setup.update(step))
        setup.check()
        stats = setup.sender.delta_stats
        assert stats is not None
        if stats.mode == "delta":
            assert 0 < stats.wire_bytes < 0.25 * stats.full_bytes, stats
    # First update full, then deltas, a full anchor after every 5 deltas.
    assert modes == ["full"] + ["delta"] * 5 + ["full"] + ["delta"] * 5 + ["full"], modes


@pytest.mark.timeout(120)
def test_dense_step_falls_back_to_full(setup: Setup) -> None:
    _perturb(setup.src, 1, 0.02)
    assert setup.update(1) == "full"
    _perturb(setup.src, 2, 0.02)
    assert setup.update(2) == "delta"
    _perturb(setup.src, 3, 0.6)  # most elements change: a delta is no smaller than full
    assert setup.update(3) == "delta"
    setup.check()
    stats = setup.sender.delta_stats
    assert stats is not None and stats.wire_bytes > 0.5 * stats.full_bytes
    _perturb(setup.src, 4, 0.02)
    assert setup.update(4) == "full"
    assert "dense" in setup.sender.delta_stats.reason  # type: ignore[union-attr]
    setup.check()
    _perturb(setup.src, 5, 0.02)
    assert setup.update(5) == "delta"
    setup.check()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["delta", "full"])
def test_failure_in_the_middle_nothing_drifts(setup: Setup, which: str, monkeypatch: Any) -> None:
    for step in (1, 2):
        _perturb(setup.src, step, 0.02)
        setup.update(step)
    before = {n: t.clone() for n, t in setup.src.items()}
    if which == "full":
        setup.sender._delta._updates_since_full = 99  # type: ignore[union-attr]  # anchor now
    calls = {"n": 0}
    real_take = delta_sender.DeltaSession.take

    def failing_take(self: Any, peer: str, ops: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # after the first batch went through
            raise WeightTransferError("injected failure in the middle of the update")
        return real_take(self, peer, ops)

    monkeypatch.setattr(delta_sender.DeltaSession, "take", failing_take)
    _perturb(setup.src, 3, 0.02)
    with pytest.raises(WeightTransferError, match="injected"):
        setup.sender.update(3)
    assert calls["n"] >= 2
    for rx in setup.receivers:
        assert rx.applied_version == 2
        with pytest.raises(WeightTransferError):
            rx.apply_delta(3, 2.0)
    if which == "delta":
        # A failed delta wrote only patch slots: the engines still hold update 2 exactly.
        setup.check(before)
    monkeypatch.setattr(delta_sender.DeltaSession, "take", real_take)
    _perturb(setup.src, 4, 0.02)
    mode = setup.update(4)
    # After a failed delta the next can be a delta; after a failed full it must be full.
    assert mode == ("delta" if which == "delta" else "full")
    setup.check()
    _perturb(setup.src, 5, 0.02)
    setup.update(5)
    setup.check()


@pytest.mark.timeout(120)
def test_engine_that_did_not_apply_is_waited_for_once_then_sent_a_full_update() -> None:
    # Issue 40, finding 4: a missed acknowledgement costs one update, not every later one.
    s = Setup("loopback", DeltaConfig(enabled=True, apply_timeout_s=1.0, full_when_slower=False))
    try:
        s.update(1)
        _perturb(s.src, 2, 0.02)
        s.sender.update(2)  # a delta; engine 1 never applies it
        s.receivers[0].apply_delta(2, 20.0)
        _perturb(s.src, 3, 0.02)
        with pytest.raises(WeightTransferError, match=r"'e1'.*did not apply delta update 2"):
            s.sender.update(3)
        _perturb(s.src, 4, 0.02)
        assert s.update(4) == "full"  # every byte rewritten, engine 1's missed patch too
        assert s.sender.delta_stats is not None and "'e1'" in s.sender.delta_stats.reason
        s.check()
        _perturb(s.src, 5, 0.02)
        assert s.update(5) == "delta"
        s.check()
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_an_engine_whose_apply_raises_acknowledges_the_failure(monkeypatch: Any) -> None:
    # Issue 40, finding 4: any exception in apply_delta (not only a PatchError) is
    # acknowledged as a failure, so the trainers' next update is full at once instead of
    # waiting out apply_timeout_s on this one and every later one.
    from weight_transfer import receiver as receiver_module

    s = Setup("loopback", DeltaConfig(enabled=True, apply_timeout_s=30.0, full_when_slower=False))
    try:
        s.update(1)
        _perturb(s.src, 2, 0.02)
        s.sender.update(2)
        s.receivers[0].apply_delta(2, 20.0)
        real = receiver_module.apply_patch_region

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected: the apply kernel failed")

        monkeypatch.setattr(receiver_module, "apply_patch_region", broken)
        with pytest.raises(RuntimeError, match="injected"):
            s.receivers[1].apply_delta(2, 20.0)
        assert s.receivers[1].serving.state.value == "failed"
        monkeypatch.setattr(receiver_module, "apply_patch_region", real)
        _perturb(s.src, 3, 0.02)
        t0 = time.monotonic()
        assert s.update(3) == "full"
        assert time.monotonic() - t0 < 10.0
        assert s.receivers[1].check_serving() == 3
        s.check()
        _perturb(s.src, 4, 0.02)
        assert s.update(4) == "delta"
        s.check()
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_patch_slot_overflow_fails_cleanly_then_full() -> None:
    # A patch region too small for a dense step: that delta fails with nothing applied, and
    # the next update is full.
    s = Setup("loopback", DeltaConfig(enabled=True, full_when_slower=False), patch_bytes=16 << 10)
    try:
        _perturb(s.src, 1, 0.02)
        s.update(1)
        _perturb(s.src, 2, 0.001)
        assert s.update(2) == "delta"
        s.check()
        before = {n: t.clone() for n, t in s.src.items()}
        _perturb(s.src, 3, 0.5)
        with pytest.raises(WeightTransferError, match="too dense"):
            s.sender.update(3)
        s.check(before)
        _perturb(s.src, 4, 0.001)
        assert s.update(4) == "full"
        s.check()
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("aim", ["version word", "patch region"])
def test_patch_aimed_at_the_engines_own_regions_is_refused(aim: str) -> None:
    # A patch segment whose region is the engine's version word or its patch region (a
    # corrupted or hostile patch: trainers never write those through patches) is refused
    # before anything is written, the engine does not serve it, and the next update is full.
    s = Setup("loopback", DeltaConfig(enabled=True, full_when_slower=False))
    try:
        _perturb(s.src, 1, 0.02)
        s.update(1)
        _perturb(s.src, 2, 0.01)
        s.sender.update(2)
        rx = s.receivers[0]
        assert rx._patch is not None
        words = rx._patch.view(torch.int64)
        slot = 64 // 8  # slot 0's header (one trainer rank)
        nseg, table_at = int(words[slot + 4]), int(words[slot + 5])
        assert nseg > 0
        row = slot + table_at // 8
        # The patch region is registered last, right after the version word (docs/delta.md).
        target = len(rx._regions) - (2 if aim == "version word" else 1)
        words[row] = target  # the first segment's region
        words[row + 1] = 0  # its destination offset
        before = [t.clone() for t in s.engines[0].values()]
        patch_before = rx._patch.clone()
        with pytest.raises(PatchError, match="destination outside region"):
            rx.apply_delta(2, 20.0)
        for got, want in zip(s.engines[0].values(), before, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(rx._patch, patch_before)
        s.receivers[1].apply_delta(2, 20.0)
        _perturb(s.src, 3, 0.01)
        assert s.update(3) == "full"
        s.check()
    finally:
        s.close()


def test_patch_error_is_a_weight_transfer_error() -> None:
    assert issubclass(PatchError, WeightTransferError)


@pytest.mark.timeout(180)
def test_verification_catches_a_corrupted_engine_and_the_next_update_repairs_it() -> None:
    s = Setup("loopback", DeltaConfig(enabled=True, verify=True, full_when_slower=False))
    try:
        for step in (1, 2, 3):  # full, delta, delta: each verified at the start of the next
            _perturb(s.src, step, 0.02)
            s.update(step)
        s.check()
        # A byte of engine 1 changes behind the trainers' back (not through any update).
        s.engines[1]["o_proj"].view(torch.uint8).view(-1)[17] ^= 0x40
        _perturb(s.src, 4, 0.02)
        s.update(4)  # verifies update 3 first: it was intact then
        _perturb(s.src, 5, 0.02)
        with pytest.raises(WeightTransferError, match=r"verification of update 4: engine\(s\) e1 "):
            s.sender.update(5)
        _perturb(s.src, 6, 0.02)
        assert s.update(6) == "full"  # every byte rewritten
        s.check()
        _perturb(s.src, 7, 0.02)
        assert s.update(7) == "delta"  # and update 6 verified clean
        s.check()
    finally:
        s.close()


def test_speed_guard_sends_full_while_deltas_are_slower() -> None:
    g = SpeedGuard(enabled=True, retry_after=2)
    assert g.reason_for_full() is None  # nothing measured yet
    g.record("full", 0.010)
    g.record("delta", 0.005)  # faster: deltas go on
    assert g.reason_for_full() is None
    g.record("delta", 0.030)  # slower than the last full update
    why = g.reason_for_full()
    assert why is not None and "30.0 ms" in why and "10.0 ms" in why
    g.record("full", 0.012)
    assert g.reason_for_full() is not None  # one full update of the two before a retry
    g.record("full", 0.011)
    assert g.reason_for_full() is None  # retry a delta
    g.record("delta", 0.004)  # faster now: no more fallback
    g.record("full", 0.011)
    assert g.reason_for_full() is None
    off = SpeedGuard(enabled=False, retry_after=1)
    off.record("full", 0.001)
    off.record("delta", 1.0)
    assert off.reason_for_full() is None


def test_full_when_slower_decides_from_the_updates_it_timed() -> None:
    """With the guard on (the default), the update after a delta is full exactly when that
    delta took longer than the last full update, as this rank timed them; the bytes stay
    exact either way."""
    s = Setup("loopback", DeltaConfig(enabled=True, retry_delta_after_updates=1))
    try:
        assert s.update(1) == "full"
        _perturb(s.src, 2, 0.02)
        assert s.update(2) == "delta"
        session = s.sender._delta
        assert session is not None
        slower = session.speed.last_delta_s > session.speed.last_full_s  # type: ignore[operator]
        _perturb(s.src, 3, 0.02)
        mode = s.update(3)
        assert mode == ("full" if slower else "delta")
        assert s.sender.delta_stats is not None
        assert ("slower" in s.sender.delta_stats.reason) == slower
        s.check()
        _perturb(s.src, 4, 0.02)
        mode = s.update(4)
        if slower:
            assert mode == "delta"  # tried again after one full update
        s.check()
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["loopback", "tcp"])
def test_apply_delta_of_a_skipped_step_applies_the_update_that_ended_the_wait(
    backend: str,
) -> None:
    # Issue 40, finding 1. The trainers skip step 2; the engine waits for it. Its wait ends
    # with update 3 (a delta): that is the patch it must apply, acknowledge and serve.
    s = Setup(backend, DeltaConfig(enabled=True, apply_timeout_s=2.0, full_when_slower=False))
    try:
        _perturb(s.src, 1, 0.02)
        assert s.update(1) == "full"
        _perturb(s.src, 3, 0.02)
        s.sender.update(3)
        assert s.sender.delta_stats is not None and s.sender.delta_stats.mode == "delta"
        for rx in s.receivers:
            stats = rx.apply_delta(2, 20.0)
            assert stats.step == 3 and stats.num_segments > 0, stats
            assert rx.applied_version == 3 and rx.version == 3
            assert rx.check_serving() == 3
        s.check()
        for step in (4, 5):  # the trainers heard every engine apply 3: deltas go on
            _perturb(s.src, step, 0.02)
            assert s.update(step) == "delta"
            s.check()
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_a_new_session_never_applies_an_old_sessions_patch() -> None:
    # Issue 40, finding 2 (delta side). The old session's last update (2) was a delta; after
    # a controller restart the new trainer job's first update, numbered 2 again, is full. The
    # patch region still holds the old slots headed 2: they must not be taken for this one.
    import gc

    s = Setup("loopback", DeltaConfig(enabled=True, full_when_slower=False))
    try:
        _perturb(s.src, 1, 0.02)
        assert s.update(1) == "full"
        _perturb(s.src, 2, 0.02)
        assert s.update(2) == "delta"
        config = s.sender.transfer_config
        s.sender.close()
        s.ctrl.close(linger_s=0)
        del s.sender, s.ctrl
        gc.collect()
        s.ctrl = Controller(config.controller_config(1), config.control)
        for rx in s.receivers:
            rx.join_new_session()
        s.src = _trainer(7)
        s.sender = WeightSender(s.src, config, controller=s.ctrl)
        assert s.update(2) == "full"
        s.check()
        _perturb(s.src, 3, 0.02)
        assert s.update(3) == "delta"
        s.check()
    finally:
        s.close()
