"""Runtime in one process: controller, receiver and sender wired together; bad input refused."""

from __future__ import annotations

import secrets

import pytest
import torch

from weight_transfer.backends.base import (
    ConfigurationError,
    ControlPlaneAuthError,
    PlanMismatchError,
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
from weight_transfer.errors import UpdateFailedError
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.recipes import column_shard, identity, row_shard
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender


def control(
    timeout_s: float = 20.0, token: str | None = None, port: int | None = None
) -> ControlPlaneConfig:
    return ControlPlaneConfig(
        port=port or free_port(), token=token or secrets.token_hex(16), timeout_s=timeout_s
    )


def config(
    cp: ControlPlaneConfig,
    backend: str = "loopback",
    *,
    num_engines: int = 1,
    budget: int = 1 << 20,
    update_timeout_s: float = 20.0,
) -> TransferConfig:
    return TransferConfig(
        transport=backend,
        num_engines=num_engines,
        control=cp,
        sender=SenderConfig(update_timeout_s=update_timeout_s),
        planner=PlannerConfig(memory_budget_bytes=budget),
    )


def trainer_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
    }


def engine_setup(tp_rank: int = 0, tp: int = 2):
    recipes = (
        column_shard("a.weight", "a.weight", (37, 19), tp_rank=tp_rank, tp_size=tp),
        identity("b.weight", "b.weight", (5,)),
    )
    rows = recipes[0].parts[0].source_box[0]
    g = torch.Generator().manual_seed(100 + tp_rank)
    tensors = {
        "a.weight": torch.randn(rows[1] - rows[0], 19, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
    }
    return recipes, tensors, rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["loopback", "tcp"])
def test_single_process_updates(backend: str) -> None:
    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=2), cp)
    receivers, engine_tensors, rows = [], [], []
    for e in range(2):
        recipes, tensors, r = engine_setup(e)
        receivers.append(WeightReceiver(tensors, recipes, config(cp, backend), engine=f"e{e}"))
        engine_tensors.append(tensors)
        rows.append(r)
    src = trainer_tensors(1)
    sender = WeightSender(src, config(cp, backend), rank=0, world_size=1, controller=ctrl)
    try:
        for step in (1, 2):
            with torch.no_grad():
                for t in src.values():
                    t.add_(
                        torch.randn(t.shape, generator=torch.Generator().manual_seed(step)).to(
                            t.dtype
                        )
                    )
            stats = sender.update(step)
            assert stats.nbytes == 37 * 19 * 2 + 2 * 5 * 2
            for e in range(2):
                assert receivers[e].version == step
                a, b = rows[e]
                assert torch.equal(engine_tensors[e]["a.weight"], src["a.weight"][a:b])
                assert torch.equal(engine_tensors[e]["b.weight"], src["b.weight"])
        with pytest.raises(ValueError, match="larger than the previous"):
            sender.update(2)
        events = sender.trace_events()
        by_step = {k: [e for e in events if e["args"]["step"] == k] for k in (1, 2)}
        assert by_step[1] and by_step[2]
        # One timeline: update 2's events come after update 1's (ts did restart at every step).
        assert min(e["ts"] for e in by_step[2]) >= max(e["ts"] + e["dur"] for e in by_step[1])
    finally:
        sender.close()
        for r in receivers:
            r.close()


@pytest.mark.timeout(60)
def test_engine_name_registered_twice() -> None:
    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)  # noqa: F841 (hosts the store)
    recipes, tensors, _ = engine_setup()
    r1 = WeightReceiver(tensors, recipes, config(cp), engine="e0")
    try:
        recipes2, tensors2, _ = engine_setup()
        with pytest.raises(ConfigurationError, match="'e0' is already registered"):
            WeightReceiver(tensors2, recipes2, config(cp), engine="e0")
    finally:
        r1.close()


@pytest.mark.timeout(60)
def test_wrong_token_refused() -> None:
    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)  # noqa: F841 (hosts the store)
    recipes, tensors, _ = engine_setup()
    bad = ControlPlaneConfig(port=cp.port, token=secrets.token_hex(16), timeout_s=5)
    with pytest.raises(ControlPlaneAuthError, match="do not share this token"):
        WeightReceiver(tensors, recipes, config(bad), engine="e0")


@pytest.mark.timeout(60)
def test_plan_mismatch_raises_before_any_byte_moves() -> None:
    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    recipes, tensors, _ = engine_setup(0, 1)
    before = {n: t.clone() for n, t in tensors.items()}
    rx = WeightReceiver(tensors, recipes, config(cp), engine="e0")
    src = trainer_tensors(1)
    src["c.weight"] = torch.randn(3, 3).to(torch.bfloat16)  # extra
    del src["b.weight"]  # missing
    try:
        with pytest.raises(PlanMismatchError) as info:
            WeightSender(src, config(cp), rank=0, world_size=1, controller=ctrl)
        text = str(info.value)
        assert "'b.weight'" in text and "which no trainer rank has" in text
        assert "'c.weight'" in text and "extra" in text
        for n in tensors:
            assert torch.equal(tensors[n], before[n])
        assert rx.version == 0
    finally:
        rx.close()


@pytest.mark.timeout(60)
def test_engine_that_never_shows_up_times_out() -> None:
    cp = control(timeout_s=2)
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=2), cp)
    recipes, tensors, _ = engine_setup(0, 2)
    rx = WeightReceiver(tensors, recipes, config(cp), engine="e0")
    try:
        with pytest.raises(TransportTimeoutError, match="1 of 2 engines joined"):
            WeightSender(trainer_tensors(1), config(cp), rank=0, world_size=1, controller=ctrl)
    finally:
        rx.close()


@pytest.mark.timeout(60)
def test_trainer_rank_that_never_shows_up_times_out() -> None:
    cp = control(timeout_s=2)
    ctrl = Controller(ControllerConfig(num_trainer_ranks=2, num_engines=1), cp)
    with pytest.raises(TransportTimeoutError, match=r"trainer rank\(s\) \[1\] did not join"):
        WeightSender(trainer_tensors(1), config(cp), rank=0, world_size=2, controller=ctrl)


@pytest.mark.timeout(60)
def test_no_control_plane_times_out() -> None:
    with pytest.raises(TransportTimeoutError, match="could not reach the control plane"):
        recipes, tensors, _ = engine_setup()
        WeightReceiver(tensors, recipes, config(control(timeout_s=1)), engine="e0")


def test_receiver_refuses_unwritten_and_missing_tensors() -> None:
    cp = control(timeout_s=1)
    recipes, tensors, _ = engine_setup()
    tensors["stray.weight"] = torch.randn(2)
    with pytest.raises(ConfigurationError, match="'stray.weight' is written by no recipe"):
        WeightReceiver(tensors, recipes, config(cp), engine="e0")
    del tensors["stray.weight"]
    del tensors["b.weight"]
    with pytest.raises(ConfigurationError, match="'b.weight', which the engine does not have"):
        WeightReceiver(tensors, recipes, config(cp), engine="e0")
    recipes, tensors, _ = engine_setup()
    tensors["a.weight"] = torch.randn(19, 19).to(torch.bfloat16).t()
    with pytest.raises(ConfigurationError, match="'a.weight' is not contiguous"):
        WeightReceiver(tensors, recipes, config(cp), engine="e0")


def test_engine_shape_mismatch_named_by_planner() -> None:
    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    recipes, tensors, _ = engine_setup(0, 2)
    tensors["a.weight"] = torch.randn(20, 19).to(torch.bfloat16)  # tp shard has 19 rows
    rx = WeightReceiver(tensors, recipes, config(cp), engine="e0")
    try:
        with pytest.raises(PlanMismatchError, match="'a.weight'"):
            WeightSender(trainer_tensors(1), config(cp), rank=0, world_size=1, controller=ctrl)
    finally:
        rx.close()


def test_weight_transfer_error_hierarchy() -> None:
    assert issubclass(PlanMismatchError, WeightTransferError)
    assert issubclass(TransportTimeoutError, TimeoutError)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows", [256, 200], ids=["block-aligned", "unaligned"])
def test_fp8_fused_quantization_matches_reference(rows: int) -> None:
    """Both quantization paths: per part straight from the source (parts on 128-row block
    boundaries) and through a float32 assembly (a block straddles gate and up)."""
    from weight_transfer.manifest import torch_dtype
    from weight_transfer.planner.recipes import engine_tensor_specs, fused_gate_up, with_fp8
    from weight_transfer.planner.reference import materialize

    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    g = torch.Generator().manual_seed(rows)
    src = {
        "gate.weight": (torch.randn(rows, 384, generator=g) * 3).to(torch.bfloat16),
        "up.weight": torch.randn(rows, 384, generator=g).to(torch.bfloat16),
    }
    recipes = (
        with_fp8(
            fused_gate_up(
                "gate_up.weight",
                "gate.weight",
                "up.weight",
                shape=(rows, 384),
                tp_rank=0,
                tp_size=1,
            )
        ),
    )
    specs = engine_tensor_specs(recipes)
    tensors = {s.name: torch.randn(s.shape, generator=g).to(torch_dtype(s.dtype)) for s in specs}
    rx = WeightReceiver(tensors, recipes, config(cp), engine="e0")
    sender = WeightSender(src, config(cp), rank=0, world_size=1, controller=ctrl)
    try:
        sender.update(1)
        want = materialize(recipes, specs, src)
        for name, t in want.items():
            assert torch.equal(tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    finally:
        sender.close()
        rx.close()


@pytest.mark.timeout(120)
def test_reallocated_parameter_fails_the_update_and_no_engine_advances() -> None:
    # Zero-copy writes are checked against reallocation while they run (after the first
    # update): a parameter whose storage was swapped must fail the update, naming it.
    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    recipes, tensors, _ = engine_setup(0, tp=1)
    rx = WeightReceiver(tensors, recipes, config(cp, "loopback"), engine="e0")
    src = trainer_tensors(3)
    sender = WeightSender(src, config(cp, "loopback"), rank=0, world_size=1, controller=ctrl)
    try:
        sender.update(1)
        assert torch.equal(tensors["a.weight"], src["a.weight"])
        # Update 2 takes the fast check (all addresses compared as one list): in-place changes
        # pass; then a swapped storage must still be found and named.
        src["a.weight"].add_(1.0)
        sender.update(2)
        assert torch.equal(tensors["a.weight"], src["a.weight"])
        src["a.weight"].set_(torch.randn(37, 19).to(torch.bfloat16))
        with pytest.raises(UpdateFailedError, match="'a.weight' was reallocated") as info:
            sender.update(3)
        assert info.value.step == 3 and info.value.retryable
        assert rx.version == 2
        with pytest.raises(UpdateFailedError, match="update 3 failed and was not applied"):
            rx.wait_for_version(3, 5.0)  # the engine side learns it by type too
    finally:
        sender.close()
        rx.close()
        ctrl.close()


@pytest.mark.timeout(120)
def test_engines_join_a_restarted_controller_without_restarting() -> None:
    """The trainer job (and the controller in it) restarts on the same port; the engines keep
    running, lose the controller, call `join_new_session()` once each, and the new trainer job
    updates them (a new run: new run id, new plan, new connections)."""
    import gc

    from weight_transfer.backends.base import PeerLostError

    cp = control(timeout_s=10)
    receivers, engine_tensors, rows = [], [], []
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=2), cp)
    for e in range(2):
        recipes, tensors, r = engine_setup(e)
        receivers.append(WeightReceiver(tensors, recipes, config(cp, "tcp"), engine=f"e{e}"))
        engine_tensors.append(tensors)
        rows.append(r)
    src = trainer_tensors(1)
    sender = WeightSender(src, config(cp, "tcp"), rank=0, world_size=1, controller=ctrl)
    try:
        sender.update(1)
        first_run = ctrl.control.run_id
        # The trainer job ends: its sender, controller and the store it hosted go away.
        sender.close()
        ctrl.close()
        del sender, ctrl
        gc.collect()
        with pytest.raises((PeerLostError, TransportTimeoutError)):
            receivers[0].wait_for_version(2, 2.0)
        ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=2), cp)
        assert ctrl.control.run_id != first_run
        for rx in receivers:
            rx.join_new_session()
            # What it holds is still reported (no wait of the new session ends on it:
            # test_after_join_new_session_the_old_version_word_does_not_end_a_wait).
            assert rx.version == 1
        with pytest.raises(ConfigurationError, match="already registered"):
            receivers[0].join_new_session()  # twice in one session is a mistake, named
        src = trainer_tensors(2)
        sender = WeightSender(src, config(cp, "tcp"), rank=0, world_size=1, controller=ctrl)
        sender.update(2)
        for e in range(2):
            assert receivers[e].wait_for_version(2, 5.0) == 2
            a, b = rows[e]
            assert torch.equal(engine_tensors[e]["a.weight"], src["a.weight"][a:b])
            assert torch.equal(engine_tensors[e]["b.weight"], src["b.weight"])
    finally:
        sender.close()
        for r in receivers:
            r.close()


@pytest.mark.timeout(60)
def test_after_join_new_session_the_old_version_word_does_not_end_a_wait() -> None:
    """Issue 40, finding 2. The old session reached update 2; the trainer job restarts (say
    after a controller crash mid-update 3) and counts from 1 again. The word the engine kept
    (2) was not written by the new session: a wait in it must not end on that word (the gate
    would read SERVING while the new session's update 1 lands), and a wait started before the
    new session's first update must end with it."""
    import gc
    import threading

    from weight_transfer.serving import ServingState

    cp = control(timeout_s=10)
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    recipes, tensors, _ = engine_setup(0, tp=1)
    rx = WeightReceiver(tensors, recipes, config(cp, "tcp"), engine="e0")
    sender: WeightSender | None = WeightSender(
        trainer_tensors(1), config(cp, "tcp"), controller=ctrl
    )
    try:
        assert sender is not None
        sender.update(1)
        sender.update(2)
        assert rx.wait_for_version(2, 5.0) == 2
        sender.close()
        ctrl.close()
        sender = None
        del ctrl
        gc.collect()
        ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
        rx.join_new_session()
        assert rx.version == 2 and rx.check_serving() == 2  # it still serves what it holds
        with pytest.raises(TransportTimeoutError):
            rx.wait_for_version(1, 0.3)
        assert rx.serving.state is ServingState.UPDATING
        src = trainer_tensors(2)
        sender = WeightSender(src, config(cp, "tcp"), controller=ctrl)
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(rx.wait_for_version(1, 10.0)))
        waiter.start()
        sender.update(1)
        waiter.join(15)
        assert got == [1] and rx.version == 1 and rx.check_serving() == 1
        assert torch.equal(tensors["a.weight"], src["a.weight"])
        assert torch.equal(tensors["b.weight"], src["b.weight"])
    finally:
        if sender is not None:
            sender.close()
        rx.close()


@pytest.mark.timeout(120)
def test_rank_zero_sender_hosts_the_controller() -> None:
    """No controller made by hand and no process group: the sender is rank 0 of 1, hosts the
    control plane the engines (started first, as in docs/api.md) are waiting for, plans, and
    closes the controller with itself."""
    import threading

    cp = control()
    cfg = config(cp, num_engines=2)
    receivers: dict[int, WeightReceiver] = {}
    setups = [engine_setup(e) for e in range(2)]
    failures: list[BaseException] = []

    def engine(e: int) -> None:
        recipes, tensors, _ = setups[e]
        try:
            receivers[e] = WeightReceiver(tensors, recipes, cfg, engine=f"e{e}")
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=engine, args=(e,)) for e in range(2)]
    for t in threads:
        t.start()
    src = trainer_tensors(5)
    sender = WeightSender(src, cfg)
    try:
        for t in threads:
            t.join(30)
        assert not failures, failures
        assert (sender.rank, sender.world_size) == (0, 1)
        assert sender.controller is not None
        sender.update(1)
        for e, (_, tensors, (a, b)) in enumerate(setups):
            assert receivers[e].wait_for_version(1, 5.0) == 1
            assert torch.equal(tensors["a.weight"], src["a.weight"][a:b])
            assert torch.equal(tensors["b.weight"], src["b.weight"])
    finally:
        sender.close()
        for rx in receivers.values():
            rx.close()
    with pytest.raises(WeightTransferError, match="connection is closed"):
        sender.controller.control.exists("hello")  # closed with the sender


def test_rank_zero_without_num_engines_is_refused_before_hosting() -> None:
    cp = control()
    with pytest.raises(ConfigurationError, match="num_engines is not set"):
        WeightSender(trainer_tensors(1), TransferConfig(control=cp))


@pytest.mark.timeout(120)
def test_one_budget_drives_planner_and_executor() -> None:
    """The planner's budget is the executor's: a 4 MiB float32 tensor cast into a bfloat16
    engine tensor goes through a 1 MiB budget (before, a sender budget smaller than the
    planner's failed the construction), and the staging arena is half that budget."""
    cp = control()
    ctrl = Controller(config(cp).controller_config(1), cp)
    g = torch.Generator().manual_seed(9)
    src = {"w": torch.randn(1024, 1024, generator=g)}
    tensors = {"w": torch.randn(1024, 1024, generator=g).to(torch.bfloat16)}
    rx = WeightReceiver(tensors, (identity("w", "w", (1024, 1024)),), config(cp), engine="e0")
    sender = WeightSender(src, config(cp), controller=ctrl)
    try:
        assert sender.schedule.memory_budget_bytes == 1 << 20
        assert sender._executor.arena.nbytes == (1 << 20) // 2
        sender.update(1)
        assert torch.equal(tensors["w"], src["w"].to(torch.bfloat16))
    finally:
        sender.close()
        rx.close()
        ctrl.close()


# -- sources checked, tied parameters (issue 23) -------------------------------------------------


@pytest.mark.timeout(120)
def test_mismatched_source_shape_fails_the_plan_on_every_rank() -> None:
    """Two trainer ranks hold an `a.weight` of 41 rows where the engine's recipe was built for
    37: both raise `PlanMismatchError` with the same list (before, the plan sent rows 0-18 of
    the larger tensor and reported success)."""
    import threading

    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=2, num_engines=1), cp)
    recipes, tensors, _ = engine_setup(0, 2)
    before = {n: t.clone() for n, t in tensors.items()}
    rx = WeightReceiver(tensors, recipes, config(cp), engine="e0")
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        src = trainer_tensors(r)
        src["a.weight"] = torch.randn(41, 19).to(torch.bfloat16)
        try:
            WeightSender(src, config(cp), rank=r, world_size=2, controller=ctrl if r == 0 else None)
        except BaseException as exc:  # handed to the test
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        want = [
            "trainer tensor 'a.weight' is shape (41, 19), but engine 'e0' reads it for "
            "'a.weight' as shape (37, 19)"
        ]
        for r in (0, 1):
            assert isinstance(errors.get(r), PlanMismatchError), errors
            assert errors[r].problems == want  # type: ignore[attr-defined]
        for n in tensors:
            assert torch.equal(tensors[n], before[n])
        assert rx.version == 0
    finally:
        rx.close()
        ctrl.close()


class _TiedLM(torch.nn.Module):
    """An embedding and an LM head that share one weight (``tie_word_embeddings``)."""

    def __init__(self, vocab: int, hidden: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.Linear(hidden, hidden, bias=False)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine_tied", [True, False])
def test_tied_module_is_sent_as_one_source(engine_tied: bool) -> None:
    """A module whose LM head shares the embedding's weight (``named_parameters(remove_duplicate
    =False)`` lists it twice) updates an engine that ties them too (one tensor) or one that
    keeps a separate LM head (both filled from the one source)."""
    model = _TiedLM(40, 16, seed=3)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert names == ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
    recipes = [
        column_shard("embed_tokens.weight", "embed_tokens.weight", (40, 16), tp_rank=1, tp_size=2),
        identity("norm.weight", "norm.weight", (16, 16)),
    ]
    if not engine_tied:
        recipes.append(identity("lm_head.weight", "lm_head.weight", (40, 16)))
    g = torch.Generator().manual_seed(4)
    tensors = {
        "embed_tokens.weight": torch.randn(20, 16, generator=g),
        "norm.weight": torch.randn(16, 16, generator=g),
    }
    if not engine_tied:
        tensors["lm_head.weight"] = torch.randn(40, 16, generator=g)
    cp = control()
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    rx = WeightReceiver(tensors, recipes, config(cp), engine="e0")
    sender = WeightSender(model, config(cp), controller=ctrl)
    try:
        for step in (1, 2):
            with torch.no_grad():
                model.embed_tokens.weight.add_(1.0)
                model.norm.weight.mul_(2.0)
            stats = sender.update(step)
            w = model.embed_tokens.weight
            assert torch.equal(tensors["embed_tokens.weight"], w[20:40])
            assert torch.equal(tensors["norm.weight"], model.norm.weight)
            if not engine_tied:
                assert torch.equal(tensors["lm_head.weight"], w)
            assert stats.nbytes == 4 * (20 * 16 + 16 * 16 + (0 if engine_tied else 40 * 16))
            assert rx.version == step
    finally:
        sender.close()
        rx.close()
        ctrl.close()


@pytest.mark.timeout(60)
def test_the_staging_arena_is_what_the_schedule_stages_not_half_the_budget() -> None:
    """Issue 40, finding 18: every sender allocated and touched half the memory budget (512 MiB
    by default) as its staging arena, even for a model of a few KiB. It now holds what the
    schedule can stage at once (every task, plus the largest again for a block quarantined by
    a failed update), capped at half the budget; scratch keeps its half."""
    from weight_transfer.planner.plan import PlannerConfig as Planner

    cp = control()
    cfg = TransferConfig(
        transport="loopback",
        num_engines=1,
        control=cp,
        sender=SenderConfig(update_timeout_s=20.0),
        planner=Planner(),  # the default budget: 1 GiB
    )
    ctrl = Controller(cfg.controller_config(1), cp)
    g = torch.Generator().manual_seed(18)
    src = {
        "a.weight": torch.randn(36, 20, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
    }
    # The engine takes half of the columns (not contiguous in the trainer's tensor): staged.
    recipes = (
        row_shard("a.weight", "a.weight", (36, 20), tp_rank=1, tp_size=2),
        identity("b.weight", "b.weight", (5,)),
    )
    tensors = {
        "a.weight": torch.randn(36, 10, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
    }
    rx = WeightReceiver(tensors, recipes, cfg, engine="e0")
    sender = WeightSender(src, cfg, controller=ctrl)
    try:
        ex = sender._executor
        staged = sum(t.staging_bytes for t in sender.schedule.tasks)
        assert staged > 0, "the schedule stages nothing: the test would check nothing"
        assert ex.arena.nbytes < 64 << 10, f"arena of {ex.arena.nbytes} bytes for {staged}"
        assert ex.staging.scratch_budget == (1 << 30) - (1 << 29)
        for step in (1, 2):
            for t in src.values():
                t.mul_(-1.25)
            sender.update(step)
            assert rx.wait_for_version(step, 5.0) == step
            assert torch.equal(tensors["a.weight"], src["a.weight"][:, 10:])
            assert torch.equal(tensors["b.weight"], src["b.weight"])
    finally:
        sender.close()
        rx.close()
