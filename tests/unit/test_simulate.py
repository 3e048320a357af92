"""The simulator on small hand-built schedules whose update time can be computed by hand."""

from __future__ import annotations

import json

import pytest

from weight_transfer.planner.simulate import GB, Rates, broadcast_baseline, load_rates, simulate
from weight_transfer.planner.types import (
    Part,
    QuantWrite,
    RankSchedule,
    Schedule,
    SliceWrite,
    SourceManifest,
    SourceTensor,
    Task,
    WriteRun,
)

NIC = 10.0  # GB/s
RATES = Rates(
    nic_gb_per_s=NIC, nvlink_gb_per_s=100.0, prepare_gb_per_s=20.0, quantize_gb_per_s=5.0,
    h2d_gb_per_s=4.0, barrier_s=0.0, collective_latency_s=0.0, write_latency_s=0.0,
)
MB = 10**6


def slice_write(engine: str, nbytes: int, offset: int = 0, zero_copy: bool = True) -> SliceWrite:
    return SliceWrite(
        engine=engine, dest="t", source="w", source_box=((0, nbytes // 2),),
        dest_box=((0, nbytes // 2),), dtype="bfloat16", runs=(WriteRun(0, offset, nbytes),),
        zero_copy=zero_copy,
    )


def direct(task_id: int, rank: int, writes: list[SliceWrite], group: int = 0, h2d: int = 0) -> Task:
    staging = sum(w.nbytes for w in writes if not w.zero_copy)
    return Task(
        task_id=task_id, kind="direct", mesh_group=group, mesh=(rank,), gather=(),
        writes=tuple(writes), staging_bytes=staging, scratch_bytes=0, h2d_bytes=h2d,
    )


def schedule_of(tasks: list[list[Task]], engines: tuple[str, ...], groups: int = 1) -> Schedule:
    ranks = tuple(
        RankSchedule(rank=r, tasks=tuple(ts), peers=engines, version_engines=())
        for r, ts in enumerate(tasks)
    )
    per_engine = {e: 0 for e in engines}
    for ts in tasks:
        for t in ts:
            for w in t.writes:
                per_engine[w.engine] += w.nbytes
    return Schedule(
        format_version=1, fingerprint="x", num_ranks=len(tasks), engines=engines,
        num_mesh_groups=groups, ranks=ranks,
        bytes_per_rank=tuple(sum(t.nbytes for t in ts) for ts in tasks),
        bytes_per_engine=tuple(per_engine[e] for e in engines),
    )


def sources_of(world: int, host: str = "t0", tensors: tuple[SourceTensor, ...] = ()) -> list[SourceManifest]:
    return [SourceManifest(rank=r, world_size=world, host=host, tensors=tensors) for r in range(world)]


def test_one_rank_nic_bound_prediction_equals_bound() -> None:
    b = 40 * MB
    sched = schedule_of([[direct(0, 0, [slice_write("e0", b)]), direct(1, 0, [slice_write("e0", b, b)])]], ("e0",))
    r = simulate(sched, sources_of(1), {"e0": "other"}, RATES, memory_budget_bytes=1 << 30)
    want = 2 * b / (NIC * GB)
    assert r.predicted_s == pytest.approx(want)
    assert r.lower_bound_s == pytest.approx(want)
    assert r.bottleneck in ("engine_nic", "trainer_nic")
    assert r.engine_nic_bytes.max == 2 * b


def test_receiver_contention_two_senders_one_engine() -> None:
    b = 30 * MB
    sched = schedule_of(
        [[direct(0, 0, [slice_write("e0", b)])], [direct(1, 1, [slice_write("e0", b, b)])]], ("e0",)
    )
    r = simulate(sched, sources_of(2), {"e0": "other"}, RATES, memory_budget_bytes=1 << 30)
    assert r.predicted_s == pytest.approx(2 * b / (NIC * GB))
    assert r.stage_bound_s["trainer_nic"] == pytest.approx(b / (NIC * GB))
    assert r.bottleneck == "engine_nic"
    assert r.trainer_nic_bytes.imbalance == pytest.approx(1.0)


def test_nvlink_inside_a_node() -> None:
    b = 50 * MB
    sched = schedule_of([[direct(0, 0, [slice_write("e0", b)])]], ("e0",))
    r = simulate(sched, sources_of(1, host="n0"), {"e0": "n0"}, RATES, memory_budget_bytes=1 << 30)
    assert r.predicted_s == pytest.approx(b / (100.0 * GB))
    assert r.engine_nic_bytes.max == 0


@pytest.mark.parametrize("budget_tasks", [1, 2])
def test_memory_budget_serialises_tasks(budget_tasks: int) -> None:
    # Each task packs b bytes (b / prepare rate) then writes them (b / NIC): with room for one
    # task the second one waits for the first write; with room for two, packing overlaps.
    b = 20 * MB
    tasks = [direct(i, 0, [slice_write("e0", b, i * b, zero_copy=False)]) for i in range(2)]
    sched = schedule_of([tasks], ("e0",))
    r = simulate(sched, sources_of(1), {"e0": "x"}, RATES, memory_budget_bytes=budget_tasks * b)
    pack, send = b / (20.0 * GB), b / (NIC * GB)
    want = 2 * (pack + send) if budget_tasks == 1 else pack + 2 * send
    assert r.predicted_s == pytest.approx(want)
    assert r.peak_memory_bytes == budget_tasks * b
    assert r.lower_bound_s == pytest.approx(2 * send)


def test_h2d_stage_overlaps_and_bounds() -> None:
    b = 8 * MB
    tasks = [direct(i, 0, [slice_write("e0", b, i * b)], h2d=b) for i in range(3)]
    r = simulate(schedule_of([tasks], ("e0",)), sources_of(1), {"e0": "x"}, RATES, memory_budget_bytes=1 << 30)
    h2d, send = b / (4.0 * GB), b / (NIC * GB)
    assert r.stage_bound_s["h2d"] == pytest.approx(3 * h2d)
    assert r.bottleneck == "h2d"
    assert r.predicted_s == pytest.approx(3 * h2d + send)


def gather_task(task_id: int, rank: int, writes: tuple[QuantWrite, ...], group: int = 0) -> Task:
    return Task(
        task_id=task_id, kind="gather", mesh_group=group, mesh=(0, 1), gather=("w",),
        writes=writes, staging_bytes=sum(w.nbytes for w in writes), scratch_bytes=4 * MB,
    )


def test_gather_collective_waits_for_the_slowest_mesh_rank() -> None:
    # Rank 1 first spends `slow` seconds packing a direct write; the all-gather of "w" (2 MB of
    # bf16, 1 MB into each of 2 ranks over NVLink) starts only then; rank 0 quantizes 1 MB of
    # FP8 and writes it.
    w = SourceTensor("w", (1000, 1000), "bfloat16", ((0, 500), (0, 1000)), (0, 1), "cuda")
    qw = QuantWrite(
        engine="e0", dest="q", scale_dest="q_scale_inv", block=(128, 128),
        parts=(Part("w", ((0, 1000), (0, 1000)), ((0, 1000), (0, 1000))),),
        dest_box=((0, 1000), (0, 1000)), scale_box=((0, 8), (0, 8)),
        weight_runs=(WriteRun(0, 0, 1_000_000),), scale_runs=(WriteRun(0, 1_000_000, 256),),
    )
    slow_bytes = 10 * MB
    sched = schedule_of(
        [
            [gather_task(0, 0, (qw,))],
            [direct(1, 1, [slice_write("e1", slow_bytes, zero_copy=False)]), gather_task(0, 1, ())],
        ],
        ("e0", "e1"),
    )
    srcs = [SourceManifest(rank=r, world_size=2, host="n0", tensors=(w,)) for r in range(2)]
    r = simulate(sched, srcs, {"e0": "a", "e1": "b"}, RATES, memory_budget_bytes=1 << 30)
    slow = slow_bytes / (20.0 * GB)
    gather = 1_000_000 / (100.0 * GB)
    quant = 1_000_000 / (5.0 * GB)
    write = 1_000_256 / (NIC * GB)
    assert r.predicted_s == pytest.approx(max(slow + gather + quant + write, slow + slow_bytes / (NIC * GB)))
    assert r.stage_bound_s["nvlink"] == pytest.approx(gather)


def test_barrier_between_mesh_groups() -> None:
    b = 10 * MB
    rates = Rates(**{**RATES_FIELDS, "barrier_s": 1e-3})
    sched = schedule_of(
        [
            [direct(0, 0, [slice_write("e0", b, zero_copy=False)], group=0),
             direct(1, 0, [slice_write("e0", b, b)], group=1)],
            [direct(2, 1, [slice_write("e1", 4 * b, zero_copy=False)], group=0),
             direct(3, 1, [slice_write("e1", b, 4 * b)], group=1)],
        ],
        ("e0", "e1"),
        groups=2,
    )
    r = simulate(sched, sources_of(2), {"e0": "a", "e1": "b"}, rates, memory_budget_bytes=1 << 30)
    release = 4 * b / (20.0 * GB) + 1e-3
    # Rank 0's group-1 write starts at the barrier's release (its NIC is idle by then).
    rank1_end = max(4 * b / (20.0 * GB) + 4 * b / (NIC * GB), release) + b / (NIC * GB)
    assert r.predicted_s == pytest.approx(max(release + b / (NIC * GB), rank1_end))


RATES_FIELDS = {
    "nic_gb_per_s": NIC, "nvlink_gb_per_s": 100.0, "prepare_gb_per_s": 20.0,
    "quantize_gb_per_s": 5.0, "h2d_gb_per_s": 4.0, "barrier_s": 0.0,
    "collective_latency_s": 0.0, "write_latency_s": 0.0,
}


def test_rates_from_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "rates.json"
    p.write_text(json.dumps({"nic_gb_per_s": 25.0, "quantize_gb_per_s": 700}))
    r = load_rates(p)
    assert r.nic_gb_per_s == 25.0 and r.quantize_gb_per_s == 700 and r.nics_per_gpu == 1
    p.write_text(json.dumps({"nic_gbps": 25.0}))
    with pytest.raises(ValueError, match="nic_gbps"):
        load_rates(p)
    p.write_text(json.dumps({"nic_gb_per_s": -1}))
    with pytest.raises(ValueError, match="nic_gb_per_s"):
        load_rates(p)
    p.write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_rates(p)


def test_nics_per_gpu_add_up() -> None:
    b = 40 * MB
    sched = schedule_of([[direct(0, 0, [slice_write("e0", b)])]], ("e0",))
    two = Rates(**{**RATES_FIELDS, "nics_per_gpu": 2})
    r = simulate(sched, sources_of(1), {"e0": "x"}, two, memory_budget_bytes=1 << 30)
    assert r.predicted_s == pytest.approx(b / (2 * NIC * GB))


def test_broadcast_baseline_closed_form() -> None:
    model = 8 * GB
    base = broadcast_baseline(int(model), [int(2 * GB)] * 4, RATES, bucket_bytes=int(GB))
    gather = bcast = model / (NIC * GB)
    load = 2 * GB / (5.0 * GB)
    assert base.num_buckets == 8
    assert base.predicted_s == pytest.approx((gather + bcast + load) / 8 + 7 * max(gather, bcast, load) / 8)


def test_missing_engine_host_is_named() -> None:
    sched = schedule_of([[direct(0, 0, [slice_write("e0", MB)])]], ("e0",))
    with pytest.raises(ValueError, match="e0"):
        simulate(sched, sources_of(1), {}, RATES, memory_budget_bytes=1 << 30)


def test_write_overhead_bounds_many_small_writes() -> None:
    # 100 writes of 10 kB: posting (20 us each) is slower than the link (1 us each), so the
    # update takes 100 postings plus the last write's bytes on the link.
    n, b, post = 100, 10_000, 20e-6
    writes = [slice_write("e0", b, i * b) for i in range(n)]
    sched = schedule_of([[direct(0, 0, writes)]], ("e0",))
    rates = Rates(**{**RATES_FIELDS, "write_overhead_s": post})
    r = simulate(sched, sources_of(1), {"e0": "x"}, rates, memory_budget_bytes=1 << 30)
    assert r.predicted_s == pytest.approx(n * post + b / (NIC * GB))
    # Large writes: the link dominates and posting hides behind it.
    big = [slice_write("e0", 10 * MB, i * 10 * MB) for i in range(4)]
    r = simulate(schedule_of([[direct(0, 0, big)]], ("e0",)), sources_of(1), {"e0": "x"}, rates,
                 memory_budget_bytes=1 << 30)
    assert r.predicted_s == pytest.approx(post + 40 * MB / (NIC * GB))


def test_task_overhead_only_for_tasks_that_prepare() -> None:
    b = 10 * MB
    launch = 1e-3
    rates = Rates(**{**RATES_FIELDS, "task_overhead_s": launch})
    packed = schedule_of([[direct(0, 0, [slice_write("e0", b, zero_copy=False)])]], ("e0",))
    r = simulate(packed, sources_of(1), {"e0": "x"}, rates, memory_budget_bytes=1 << 30)
    assert r.predicted_s == pytest.approx(launch + b / (20.0 * GB) + b / (NIC * GB))
    zero = schedule_of([[direct(0, 0, [slice_write("e0", b)])]], ("e0",))
    r = simulate(zero, sources_of(1), {"e0": "x"}, rates, memory_budget_bytes=1 << 30)
    assert r.predicted_s == pytest.approx(b / (NIC * GB))
