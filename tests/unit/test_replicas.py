"""Engine replicas: every replica gets the same bytes, and the trainer prepares them once.

Two replicas of a tp-2 engine (four engines) take an FP8 fused gate_up, a column slice that
must be staged (not contiguous in the trainer tensor) and a norm. The oracle slices the trainer
tensors by hand and quantizes with the reference quantizer (`planner.fp8`); the count of
quantizer calls shows that each unit was quantized once per update, not once per replica.
Full updates and deltas alike. On a GPU the same holds for the FP8 graph groups
(`pipeline.graphs`), whose captured quantize calls are counted.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from tests.markers import requires_cuda, requires_module
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import (
    ControlPlaneConfig,
    DeltaConfig,
    ReceiverConfig,
    SenderConfig,
    TransferConfig,
)
from weight_transfer.controller import Controller
from weight_transfer.manifest import torch_dtype
from weight_transfer.planner import fp8
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.recipes import (
    engine_tensor_specs,
    fused_gate_up,
    identity,
    row_shard,
    with_fp8,
)
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

H, INTER, TP, REPLICAS = 256, 512, 2, 2
REFERENCE = fp8.quantize_fp8_blockwise


def _trainer(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate": (INTER, H), "up": (INTER, H), "o": (H, 2 * H), "norm": (H,)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def _recipes(r: int) -> tuple[object, ...]:
    return (
        with_fp8(fused_gate_up("gate_up", "gate", "up", shape=(INTER, H), tp_rank=r, tp_size=TP)),
        row_shard("o_proj", "o", (H, 2 * H), tp_rank=r, tp_size=TP),
        identity("norm", "norm", (H,)),
    )


def _expected(src: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    rows, cols = INTER // TP, 2 * H // TP
    gate_up = torch.cat(
        [src["gate"][r * rows : (r + 1) * rows], src["up"][r * rows : (r + 1) * rows]]
    )
    q, s = REFERENCE(gate_up)
    return {
        "gate_up": q,
        "gate_up_scale_inv": s,
        "o_proj": src["o"][:, r * cols : (r + 1) * cols],
        "norm": src["norm"],
    }


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_replicas_get_the_same_bytes_and_each_unit_is_quantized_once(
    delta: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, ...]] = []

    def counting(x: torch.Tensor, block: tuple[int, int] = (128, 128)):  # type: ignore[no-untyped-def]
        calls.append(tuple(x.shape))
        return REFERENCE(x, block)

    monkeypatch.setattr(fp8, "quantize_fp8_blockwise", counting)
    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=20.0)
    config = TransferConfig(
        transport="loopback",
        num_engines=TP * REPLICAS,
        control=cp,
        sender=SenderConfig(
            update_timeout_s=20,
            delta=DeltaConfig(enabled=delta, anchor_every_updates=0, full_when_slower=False),
        ),
        receiver=ReceiverConfig(patch_region_bytes=1 << 20),
        planner=PlannerConfig(memory_budget_bytes=4 << 20),
    )
    ctrl = Controller(config.controller_config(1), cp)
    engines: list[tuple[int, dict[str, torch.Tensor]]] = []
    receivers: list[WeightReceiver] = []
    src = _trainer(1)
    sender = None
    try:
        for i in range(TP * REPLICAS):
            r = i % TP
            recipes = _recipes(r)
            g = torch.Generator().manual_seed(50 + i)
            tensors = {
                s.name: torch.randn(s.shape, generator=g).to(torch_dtype(s.dtype))
                for s in engine_tensor_specs(recipes)  # type: ignore[arg-type]
            }
            engines.append((r, tensors))
            receivers.append(
                WeightReceiver(tensors, recipes, config, engine=f"replica{i // TP}-tp{r}")
            )
        sender = WeightSender(src, config, controller=ctrl)
        for step in range(1, 5):
            g = torch.Generator().manual_seed(1000 + step)
            with torch.no_grad():
                for t in src.values():
                    mask = torch.rand(t.shape, generator=g) < 0.03
                    t[mask] = (t[mask].float() * 1.05).to(t.dtype)
            calls.clear()
            sender.update(step)
            if delta:
                for rx in receivers:
                    rx.apply_delta(step, 20.0)
                assert sender.delta_stats is not None
                assert sender.delta_stats.mode == ("full" if step == 1 else "delta")
            # gate and up rows of each tp rank lie on whole 128-row blocks: one call per part,
            # two parts per tp rank, whatever the number of replicas.
            assert sorted(calls) == [(INTER // TP, H)] * (2 * TP), calls
            for i, (r, tensors) in enumerate(engines):
                for name, want in _expected(src, r).items():
                    assert _same(tensors[name], want), f"step {step} engine {i} {name}"
    finally:
        if sender is not None:
            sender.close()
        for rx in receivers:
            rx.close()
        ctrl.close()


def test_plan_counts_each_replicas_unit_once_in_a_tasks_staging() -> None:
    """Two replicas of the emulated FP8 cluster: a task's `staging_bytes` is the bytes of its
    distinct staged units (keys and sizes written here), less than the bytes it sends where
    replicas' copies share a task (a band's copies stay with the rank holding its rows); every
    rank's `bytes_per_rank` is still the bytes it sends."""
    from weight_transfer.planner.plan import plan
    from weight_transfer.planner.presets.clusters import (
        dest_manifests,
        get_preset,
        source_manifests,
        with_overrides,
    )
    from weight_transfer.planner.types import QuantWrite, numel
    from weight_transfer.planner.types import box_shape as shape_of

    preset = with_overrides(get_preset("emu-dense-fp8"), **{"engine.num_replicas": 2})
    schedule = plan(source_manifests(preset), dest_manifests(preset))
    shared = 0
    for rs in schedule.ranks:
        sent = 0
        for task in rs.tasks:
            distinct: dict[object, int] = {}
            for w in task.writes:
                if isinstance(w, QuantWrite):
                    key: object = ("q", w.block, w.parts, w.dest_box, w.scale_box)
                    size = numel(shape_of(w.dest_box)) + 4 * numel(shape_of(w.scale_box))
                elif w.zero_copy:
                    continue
                else:
                    key, size = ("s", w.source, w.source_box, w.dtype), w.nbytes
                distinct[key] = size
            assert task.staging_bytes == sum(distinct.values()), task.task_id
            shared += task.staging_bytes < sum(w.nbytes for w in task.writes if not _zero(w))
            sent += task.nbytes
        assert schedule.bytes_per_rank[rs.rank] == sent
    assert shared > 0


def _zero(w: object) -> bool:
    return getattr(w, "zero_copy", False)


@requires_cuda
@requires_module("triton")
@pytest.mark.timeout(300)
def test_gpu_graph_groups_quantize_each_unit_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 only, so every task is a local quantization and the GPU captures graph groups; delta
    mode, so units are staged (a full update on one GPU quantizes straight into each engine's
    mapped memory). Two replicas of tp 2: the fused gate_up has two parts per tp rank and the
    replicated o one part, so 2 * TP + 1 quantize calls are captured, not REPLICAS times that."""
    from weight_transfer.pipeline import graphs

    captured: list[int] = []
    real = graphs.quantize_launches

    def counting(calls, quantize, *, table):  # type: ignore[no-untyped-def]
        captured.append(len(calls))
        return real(calls, quantize, table=table)

    monkeypatch.setattr(graphs, "quantize_launches", counting)
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(5)
    shapes = {"gate": (INTER, H), "up": (INTER, H), "o": (H, 2 * H)}
    src = {n: torch.randn(s, device=dev, generator=g).to(torch.bfloat16) for n, s in shapes.items()}

    def recipes(r: int) -> tuple[object, ...]:
        gate_up = fused_gate_up("gate_up", "gate", "up", shape=(INTER, H), tp_rank=r, tp_size=TP)
        return (with_fp8(gate_up), with_fp8(identity("o_proj", "o", (H, 2 * H))))

    def expected(r: int) -> dict[str, torch.Tensor]:
        rows = INTER // TP
        cpu = {n: t.cpu() for n, t in src.items()}
        gate_up = torch.cat(
            [cpu["gate"][r * rows : (r + 1) * rows], cpu["up"][r * rows : (r + 1) * rows]]
        )
        (q, s), (oq, os_) = REFERENCE(gate_up), REFERENCE(cpu["o"])
        return {"gate_up": q, "gate_up_scale_inv": s, "o_proj": oq, "o_proj_scale_inv": os_}

    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=30.0)
    config = TransferConfig(
        transport="loopback",
        num_engines=TP * REPLICAS,
        control=cp,
        sender=SenderConfig(
            update_timeout_s=60,
            delta=DeltaConfig(
                enabled=True,
                anchor_every_updates=0,
                full_when_slower=False,
                snapshot_memory="device",
            ),
        ),
        receiver=ReceiverConfig(patch_region_bytes=4 << 20),
        planner=PlannerConfig(memory_budget_bytes=64 << 20),
    )
    ctrl = Controller(config.controller_config(1), cp)
    engines: list[tuple[int, dict[str, torch.Tensor]]] = []
    receivers: list[WeightReceiver] = []
    sender = None
    try:
        for i in range(TP * REPLICAS):
            r = i % TP
            rec = recipes(r)
            gi = torch.Generator(device=dev).manual_seed(60 + i)
            tensors = {
                s.name: torch.randn(s.shape, device=dev, generator=gi).to(torch_dtype(s.dtype))
                for s in engine_tensor_specs(rec)  # type: ignore[arg-type]
            }
            engines.append((r, tensors))
            receivers.append(WeightReceiver(tensors, rec, config, engine=f"replica{i // TP}-tp{r}"))
        sender = WeightSender(src, config, controller=ctrl, device=dev)
        assert sender._executor.graphs is not None and sender._executor.graphs.groups, (
            "the FP8 tasks were not captured as graphs"
        )
        assert sum(captured) == 2 * TP + 1, captured
        for step in range(1, 4):
            with torch.no_grad():
                for t in src.values():
                    mask = torch.rand(t.shape, device=dev, generator=g) < 0.03
                    t[mask] = (t[mask].float() * 1.05).to(t.dtype)
            sender.update(step)
            for rx in receivers:
                rx.apply_delta(step, 30.0)
            torch.cuda.synchronize()
            for i, (r, tensors) in enumerate(engines):
                for name, want in expected(r).items():
                    assert _same(tensors[name].cpu(), want), f"step {step} engine {i} {name}"
    finally:
        if sender is not None:
            sender.close()
        for rx in receivers:
            rx.close()
        ctrl.close(linger_s=0)
