"""The simulator on small hand-built schedules whose update time can be computed by hand."""

from __future__ import annotations

import json

import pytest

from weight_transfer.planner.simulate import (
    GB,
    Rates,
    binomial_broadcast_s,
    broadcast_baseline,
    funnel_baseline,
    load_rates,
    simulate,
)
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
    nic_gb_per_s=NIC,
    nvlink_gb_per_s=100.0,
    prepare_gb_per_s=20.0,
    quantize_gb_per_s=5.0,
    h2d_gb_per_s=4.0,
    barrier_s=0.0,
    collective_latency_s=0.0,
    write_latency_s=0.0,
)
MB = 10**6


def slice_write(engine: str, nbytes: int, offset: int = 0, zero_copy: bool = True) -> SliceWrite:
    return SliceWrite(
        engine=engine,
        dest="t",
        source="w",
        source_box=((0, nbytes // 2),),
        dest_box=((0, nbytes // 2),),
        dtype="bfloat16",
        runs=(WriteRun(0, offset, nbytes),),
        zero_copy=zero_copy,
    )


def direct(task_id: int, rank: int, writes: list[SliceWrite], group: int = 0, h2d: int = 0) -> Task:
    staging = sum(w.nbytes for w in writes if not w.zero_copy)
    return Task(
        task_id=task_id,
        kind="direct",
        mesh_group=group,
        mesh=(rank,),
        gather=(),
        writes=tuple(writes),
        staging_bytes=staging,
        scratch_bytes=0,
        h2d_bytes=h2d,
    )


def schedule_of(tasks: list[list[Task]], engines: tuple[str, ...], groups: int = 1) -> Schedule:
    ranks = tuple(
        RankSchedule(
            rank=r, tasks=tuple(ts), peers=engines, version_engines=(), memory_budget_bytes=1 << 30
        )
        for r, ts in enumerate(tasks)
    )
    per_engine = {e: 0 for e in engines}
    for ts in tasks:
        for t in ts:
            for w in t.writes:
                per_engine[w.engine] += w.nbytes
    return Schedule(
        format_version=1,
        fingerprint="x",
        num_ranks=len(tasks),
        engines=engines,
        num_mesh_groups=groups,
        ranks=ranks,
        bytes_per_rank=tuple(sum(t.nbytes for t in ts) for ts in tasks),
        bytes_per_engine=tuple(per_engine[e] for e in engines),
    )


def sources_of(
    world: int, host: str = "t0", tensors: tuple[SourceTensor, ...] = ()
) -> list[SourceManifest]:
    return [
        SourceManifest(rank=r, world_size=world, host=host, tensors=tensors) for r in range(world)
    ]


def test_one_rank_nic_bound_prediction_equals_bound() -> None:
    b = 40 * MB
    sched = schedule_of(
        [[direct(0, 0, [slice_write("e0", b)]), direct(1, 0, [slice_write("e0", b, b)])]], ("e0",)
    )
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
    r = simulate(
        schedule_of([tasks], ("e0",)),
        sources_of(1),
        {"e0": "x"},
        RATES,
        memory_budget_bytes=1 << 30,
    )
    h2d, send = b / (4.0 * GB), b / (NIC * GB)
    assert r.stage_bound_s["h2d"] == pytest.approx(3 * h2d)
    assert r.bottleneck == "h2d"
    assert r.predicted_s == pytest.approx(3 * h2d + send)


def gather_task(task_id: int, rank: int, writes: tuple[QuantWrite, ...], group: int = 0) -> Task:
    return Task(
        task_id=task_id,
        kind="gather",
        mesh_group=group,
        mesh=(0, 1),
        gather=("w",),
        writes=writes,
        staging_bytes=sum(w.nbytes for w in writes),
        scratch_bytes=4 * MB,
    )


def test_gather_collective_waits_for_the_slowest_mesh_rank() -> None:
    # Rank 1 first spends `slow` seconds packing a direct write; the all-gather of "w" (2 MB of
    # bf16, 1 MB into each of 2 ranks over NVLink) starts only then; rank 0 quantizes 1 MB of
    # FP8 and writes it.
    w = SourceTensor("w", (1000, 1000), "bfloat16", ((0, 500), (0, 1000)), (0, 1), "cuda")
    qw = QuantWrite(
        engine="e0",
        dest="q",
        scale_dest="q_scale_inv",
        block=(128, 128),
        parts=(Part("w", ((0, 1000), (0, 1000)), ((0, 1000), (0, 1000))),),
        dest_box=((0, 1000), (0, 1000)),
        scale_box=((0, 8), (0, 8)),
        weight_runs=(WriteRun(0, 0, 1_000_000),),
        scale_runs=(WriteRun(0, 1_000_000, 256),),
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
    assert r.predicted_s == pytest.approx(
        max(slow + gather + quant + write, slow + slow_bytes / (NIC * GB))
    )
    assert r.stage_bound_s["nvlink"] == pytest.approx(gather)


def test_barrier_between_mesh_groups() -> None:
    b = 10 * MB
    rates = Rates(**{**RATES_FIELDS, "barrier_s": 1e-3})
    sched = schedule_of(
        [
            [
                direct(0, 0, [slice_write("e0", b, zero_copy=False)], group=0),
                direct(1, 0, [slice_write("e0", b, b)], group=1),
            ],
            [
                direct(2, 1, [slice_write("e1", 4 * b, zero_copy=False)], group=0),
                direct(3, 1, [slice_write("e1", b, 4 * b)], group=1),
            ],
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
    "nic_gb_per_s": NIC,
    "nvlink_gb_per_s": 100.0,
    "prepare_gb_per_s": 20.0,
    "quantize_gb_per_s": 5.0,
    "h2d_gb_per_s": 4.0,
    "barrier_s": 0.0,
    "collective_latency_s": 0.0,
    "write_latency_s": 0.0,
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
    assert base.predicted_s == pytest.approx(
        (gather + bcast + load) / 8 + 7 * max(gather, bcast, load) / 8
    )


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
    r = simulate(
        schedule_of([[direct(0, 0, big)]], ("e0",)),
        sources_of(1),
        {"e0": "x"},
        rates,
        memory_budget_bytes=1 << 30,
    )
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


def test_fifo_links_overpredict_two_by_two_fair_links_reach_the_bound() -> None:
    # Two ranks write b to each of two engines, both in the same engine order (as the planner
    # orders a task's batches). With fair sharing (TCP) every link is busy all the time: 2b/NIC.
    # The FIFO tandem makes rank 1's batch to e0 wait behind rank 0's, then e1 serves rank 0's
    # and rank 1's batches one after the other: 3b/NIC (what the emulated cluster disproved).
    b = 20 * MB
    sched = schedule_of(
        [
            [direct(0, 0, [slice_write("e0", b), slice_write("e1", b)])],
            [direct(1, 1, [slice_write("e0", b, b), slice_write("e1", b, b)])],
        ],
        ("e0", "e1"),
    )
    hosts = {"e0": "a", "e1": "b"}
    srcs = [SourceManifest(rank=r, world_size=2, host=f"t{r}", tensors=()) for r in range(2)]
    fifo = simulate(sched, srcs, hosts, RATES, memory_budget_bytes=1 << 30, links="fifo")
    fair = simulate(sched, srcs, hosts, RATES, memory_budget_bytes=1 << 30, links="fair")
    hop = b / (NIC * GB)
    assert fair.predicted_s == pytest.approx(2 * hop)
    assert fair.lower_bound_s == pytest.approx(2 * hop)
    assert fifo.predicted_s == pytest.approx(3 * hop)


def test_fair_links_share_one_receiver() -> None:
    # Three senders into one engine: the engine's link is shared three ways, 3b/NIC in all.
    b = 10 * MB
    sched = schedule_of([[direct(r, r, [slice_write("e0", b, r * b)])] for r in range(3)], ("e0",))
    srcs = [SourceManifest(rank=r, world_size=3, host=f"t{r}", tensors=()) for r in range(3)]
    r = simulate(sched, srcs, {"e0": "x"}, RATES, memory_budget_bytes=1 << 30, links="fair")
    assert r.predicted_s == pytest.approx(3 * b / (NIC * GB))


def test_fair_links_gather_is_a_ring_over_the_nics() -> None:
    # Two ranks on two hosts all-gather a 2 MB tensor (1 MB crosses each way), rank 0 quantizes
    # 1 MB of FP8 and writes it; rank 1 writes nothing.
    w = SourceTensor("w", (1000, 1000), "bfloat16", ((0, 500), (0, 1000)), (0, 1), "cuda")
    qw = QuantWrite(
        engine="e0",
        dest="q",
        scale_dest="q_scale_inv",
        block=(128, 128),
        parts=(Part("w", ((0, 1000), (0, 1000)), ((0, 1000), (0, 1000))),),
        dest_box=((0, 1000), (0, 1000)),
        scale_box=((0, 8), (0, 8)),
        weight_runs=(WriteRun(0, 0, 1_000_000),),
        scale_runs=(WriteRun(0, 1_000_000, 256),),
    )
    sched = schedule_of([[gather_task(0, 0, (qw,))], [gather_task(0, 1, ())]], ("e0",))
    srcs = [SourceManifest(rank=r, world_size=2, host=f"n{r}", tensors=(w,)) for r in range(2)]
    r = simulate(sched, srcs, {"e0": "x"}, RATES, memory_budget_bytes=1 << 30, links="fair")
    gather = 1_000_000 / (NIC * GB)
    quant = 1_000_000 / (5.0 * GB)
    write = 1_000_256 / (NIC * GB)
    assert r.predicted_s == pytest.approx(gather + quant + write)
    assert r.stage_bound_s["trainer_nic"] == pytest.approx(gather + write)


def test_unknown_link_model_is_named() -> None:
    sched = schedule_of([[direct(0, 0, [slice_write("e0", MB)])]], ("e0",))
    with pytest.raises(ValueError, match="links must be 'fifo' or 'fair'"):
        simulate(sched, sources_of(1), {"e0": "x"}, RATES, memory_budget_bytes=1 << 30, links="tcp")


@pytest.mark.parametrize(
    ("participants", "hops"), [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (8, 6), (9, 7)]
)
def test_binomial_broadcast_follows_gloo(participants: int, hops: int) -> None:
    # gloo/broadcast.cc by hand: the root queues its sends to virtual ranks 1, 2, 4, ... at once
    # (they share its uplink); rank v forwards to v + 2^i for every 2^i > v once it received.
    # P=5: root -> 1, 2, 4 end at 3 hops, then 1 -> 3 at 4. P=8: root's three end at 3; 1 -> 3, 5
    # at 5; 2 -> 6 at 4; 3 -> 7 at 6. P=9: root's four end at 4; 1 -> 3, 5 at 6; 3 -> 7 at 7.
    assert binomial_broadcast_s(2.0, participants, 1.0) == pytest.approx(2.0 * hops)


def test_funnel_grows_with_trainer_ranks_and_pays_the_tree() -> None:
    rates = Rates(
        nic_gb_per_s=1.0, prepare_gb_per_s=1000.0, collective_latency_s=0.0, write_latency_s=0.0
    )
    params = [100 * MB] * 4
    times = [
        funnel_baseline(params, n, [200 * MB] * 4, rates, bucket_bytes=50 * MB).predicted_s
        for n in (2, 4, 8)
    ]
    gathers = [0.4 * (n - 1) / n for n in (2, 4, 8)]  # 400 MB, (n-1)/n through each NIC
    # 8 buckets of 50 MB (0.05 s per copy): rank 0 sends 3 copies of each (ranks 1, 2, 4 of 5),
    # then only the last bucket's forward 1 -> 3 is exposed (one more copy).
    bcast = 8 * 3 * 0.05 + 0.05
    load = 0.2 / 1000 / 8  # the last bucket's share of the busiest engine's copy
    assert times == pytest.approx([g + bcast + load for g in gathers])
    assert times[0] < times[1] < times[2]


def test_control_plane_is_part_of_the_predicted_update() -> None:
    """The update's control plane, computed by hand for 3 ranks and 2 engines, is added to the
    data plane's prediction (`update_s`), and stays linear in the members."""
    from weight_transfer.planner.simulate import control_plane_phases, control_plane_s

    rates = Rates(control_rtt_s=100e-6, control_request_s=10e-6, control_message_s=20e-6)
    n, m, rtt, req, msg = 3, 2, 100e-6, 10e-6, 20e-6
    # go: the write and the woken ranks' reads (2 rtt), the store serving 2 (n - 1) requests.
    go = 2 * rtt + 2 * (n - 1) * req
    # each commit phase: report in and wake-up (rtt), one wait + multi_get (2 rtt), n values,
    # n - 1 reports checked, then the verdict's fan-out (2 rtt + 2 requests per woken member).
    phase = rtt + 2 * rtt + n * req + (n - 1) * msg
    done = phase + 2 * rtt + 2 * (n - 1) * req
    committed = phase + 2 * rtt + 2 * (n - 1 + m) * req
    assert control_plane_phases(n, m, rates) == pytest.approx(
        {"go": go, "done": done, "committed": committed}
    )
    b = 10 * MB
    sched = schedule_of(
        [[direct(r, r, [slice_write(f"e{r % 2}", b, offset=(r // 2) * b)])] for r in range(n)],
        ("e0", "e1"),
    )
    r = simulate(sched, sources_of(n), {"e0": "a", "e1": "b"}, rates, memory_budget_bytes=1 << 30)
    assert r.control_plane_s == pytest.approx(go + done + committed)
    assert r.update_s == pytest.approx(r.predicted_s + r.control_plane_s)
    # 256 + 128 members cost about twice 128 + 64 (no term grows faster than the members).
    big, half = control_plane_s(256, 128, Rates()), control_plane_s(128, 64, Rates())
    assert 1.5 < big / half < 2.1


def test_delta_update_by_hand() -> None:
    """A delta of one 40 MB BF16 write at 2% density: the patch's bytes over the NIC after the
    diff, then the engine's apply; computed here from the wire format's definition."""
    from weight_transfer.planner.delta import DeltaDensity

    b = 40 * MB
    numel = b // 2
    sched = schedule_of([[direct(0, 0, [slice_write("e0", b)])]], ("e0",))
    rates = Rates(**{**RATES_FIELDS, "diff_gb_per_s": 50.0, "apply_gb_per_s": 25.0})
    full = simulate(sched, sources_of(1), {"e0": "x"}, rates, memory_budget_bytes=1 << 30)
    d = simulate(
        sched,
        sources_of(1),
        {"e0": "x"},
        rates,
        memory_budget_bytes=1 << 30,
        delta=DeltaDensity(other=0.02, fp8=0.02),
    )
    # Sparse chunk list: 4 bytes per 65536-element chunk, 2 + 2 bytes per changed element.
    chunks = -(-numel // 65536)
    changed = -(-2 * numel // 100)
    patch = 4 * chunks + 4 * changed
    assert d.mode == "delta" and d.total_write_bytes == patch and d.full_write_bytes == b
    diff_s = b / (50.0 * GB)
    apply_s = patch / (25.0 * GB)
    assert d.apply_s == pytest.approx(apply_s)
    assert d.predicted_s == pytest.approx(diff_s + patch / (NIC * GB) + apply_s)
    assert d.predicted_s < 0.3 * full.predicted_s
    # Everything changed: each run goes dense (never more bytes than a full update), and the
    # diff and apply make the delta slower than the full update.
    dense = simulate(
        sched,
        sources_of(1),
        {"e0": "x"},
        rates,
        memory_budget_bytes=1 << 30,
        delta=DeltaDensity(other=1.0, fp8=1.0),
    )
    assert dense.total_write_bytes == b
    assert dense.predicted_s > full.predicted_s


def test_delta_fp8_write_sends_scales_at_their_density() -> None:
    from weight_transfer.planner.delta import DeltaDensity, expected_wire_nbytes

    w = QuantWrite(
        engine="e0",
        dest="q",
        scale_dest="s",
        block=(128, 128),
        parts=(Part("w", ((0, 256), (0, 256)), ((0, 256), (0, 256))),),
        dest_box=((0, 256), (0, 256)),
        scale_box=((0, 2), (0, 2)),
        weight_runs=(WriteRun(0, 0, 65536),),
        scale_runs=(WriteRun(1, 0, 16),),
    )
    task = Task(
        task_id=0,
        kind="direct",
        mesh_group=0,
        mesh=(0,),
        gather=(),
        writes=(w,),
        staging_bytes=w.nbytes,
        scratch_bytes=0,
        h2d_bytes=0,
    )
    sched = schedule_of([[task]], ("e0",))
    d = simulate(
        sched,
        sources_of(1),
        {"e0": "x"},
        RATES,
        memory_budget_bytes=1 << 30,
        delta=DeltaDensity(other=0.5, fp8=0.01, scales=1.0),
    )
    assert d.total_write_bytes == expected_wire_nbytes(0.01, 65536, 1) + 16
    with pytest.raises(ValueError, match="fp8"):
        DeltaDensity(other=0.1, fp8=1.5)


def test_cli_simulate_delta_prints_both_and_refuses_bad_density(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from weight_transfer.cli import main

    assert main(["simulate", "--preset", "kimi-k2-mini", "--delta-density", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "delta update at densities 0.01 (BF16) / 0.01 (FP8 bytes)" in out
    # The second "predicted update" row is the full / delta table.
    line = [ln for ln in out.splitlines() if ln.startswith("predicted update")][-1]
    full_s, delta_s = (float(x.rstrip("s")) for x in line.split()[-2:])
    assert 0 < delta_s and 0 < full_s and "decision: " in out
    assert main(["simulate", "--preset", "kimi-k2-mini", "--delta-density", "1.5"]) == 2
    assert "--delta-density: DeltaDensity.other must be in [0, 1]" in capsys.readouterr().err


def test_cli_simulate_says_it_predicts_and_names_host_costs_it_leaves_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`simulate --preset kimi-k2` printed 0.758 s with nothing saying it is the model's
    prediction, nor that the preset's per-write and per-task host costs are 0."""
    from weight_transfer.cli import main

    assert main(["simulate", "--preset", "kimi-k2-mini"]) == 0
    out = capsys.readouterr().out
    assert "a prediction of the simulator's model" in out
    assert "counts no host cost per write and per task (0 in these rates)" in out
    rates = '{"write_overhead_s": 1e-5, "task_overhead_s": 0}'
    assert main(["simulate", "--preset", "kimi-k2-mini", "--rates", rates]) == 0
    out = capsys.readouterr().out
    assert "counts no host cost per task (0 in these rates)" in out
    rates = '{"write_overhead_s": 1e-5, "task_overhead_s": 7e-5}'
    assert main(["simulate", "--preset", "kimi-k2-mini", "--rates", rates]) == 0
    assert "counts no host cost" not in capsys.readouterr().out


def test_replicas_of_one_unit_are_prepared_once_per_task() -> None:
    """The executor stages and quantizes each distinct unit of a task once however many engine
    replicas it goes to (`pipeline.prepare`); the model charges the same: a task's preparation
    time does not change when its duplicate writes (another replica's) are left out, and a
    delta still pays one compare per write."""
    import dataclasses

    from weight_transfer.planner import simulate as sim
    from weight_transfer.planner.delta import DeltaDensity
    from weight_transfer.planner.plan import plan
    from weight_transfer.planner.presets.clusters import (
        dest_manifests,
        get_preset,
        source_manifests,
        with_overrides,
    )
    from weight_transfer.planner.types import QuantWrite as QW

    preset = with_overrides(get_preset("emu-dense-fp8"), **{"engine.num_replicas": 2})
    sources = source_manifests(preset)
    schedule = plan(sources, dest_manifests(preset))
    rates = sim.Rates()
    checked = 0
    for rs in schedule.ranks:
        for task in rs.tasks:
            seen: set[object] = set()
            unique = []
            for w in task.writes:
                key = (w.block, w.parts, w.dest_box, w.scale_box) if isinstance(w, QW) else w
                if key not in seen:
                    unique.append(w)
                seen.add(key)
            if len(unique) == len(task.writes):
                continue
            checked += 1
            one = dataclasses.replace(rs, tasks=(task,))
            alone = dataclasses.replace(
                rs, tasks=(dataclasses.replace(task, writes=tuple(unique)),)
            )
            costs = [
                sim._task_costs(
                    dataclasses.replace(schedule, ranks=(r,)), sources, rates, ["h"] * 99
                )[0][0].compute_s
                for r in (one, alone)
            ]
            assert costs[0] == pytest.approx(costs[1]), (task.task_id, costs)
            delta = DeltaDensity(other=0.01, fp8=0.01, scales=1.0)
            with_dups, without = (
                sim._task_costs(
                    dataclasses.replace(schedule, ranks=(r,)), sources, rates, ["h"] * 99, delta
                )[0][0].compute_s
                for r in (one, alone)
            )
            extra = sum(sim._diff_s(w, delta, rates) for w in task.writes) - sum(
                sim._diff_s(w, delta, rates) for w in unique
            )
            assert with_dups == pytest.approx(without + extra)
    assert checked > 0
