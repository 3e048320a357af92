"""Discrete-event model of an update: predicted time, lower bound, balance, bottleneck.

Pure: no clocks, no I/O. `simulate` replays a `Schedule` on a described cluster:

* Each trainer rank runs its tasks in order. A task is admitted when the temporary memory of
  its tasks in flight (staging until the task's writes completed, scratch until its preparation
  ended) fits `memory_budget_bytes` (a task alone is always admitted). Admission may run ahead
  of preparation, bounded by memory only.
* Host-to-device copy (offloaded shards) is a FIFO stage of its own (copy engine), at
  `Rates.h2d_gb_per_s`.
* Preparation is FIFO on the GPU: a "gather" task on a mesh of n > 1 ranks starts when every
  rank of the mesh reached it (a collective), moves ``(n - 1) / n`` of the gathered bytes into
  each rank over NVLink (mesh inside one node) or the NICs, then quantizes (FP8 bytes at
  `quantize_gb_per_s`) and packs (copied bytes at `prepare_gb_per_s`; zero-copy writes cost
  nothing).
* Writes are posted when the task is prepared, one batch per engine. A batch occupies the
  sender's NICs and then the receiver's NICs (two FIFO servers in tandem: the sender is free to
  post the next batch once its bytes left, the batch completes when the receiver took them);
  between GPUs of one host it uses NVLink instead. Completion frees the task's staging memory.
* A barrier separates mesh groups: no rank prepares a task of group g before every rank has
  prepared all its tasks of earlier groups (plus `barrier_s`).

The lower bound is the busiest resource: bytes over bandwidth of the busiest trainer NIC,
engine NIC and NVLink, and the busiest GPU's host-to-device and preparation time. The rank-0
broadcast baseline (`broadcast_baseline`) is modelled in closed form beside it.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from weight_transfer.planner.types import (
    QuantWrite,
    Schedule,
    SliceWrite,
    SourceManifest,
    box_shape,
    dtype_size,
    numel,
)

GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    """Link and stage rates of a cluster (GB/s are 10^9 bytes per second)."""

    nic_gb_per_s: float = 50.0
    """One NIC's bandwidth each way (400 Gb/s = 50 GB/s)."""
    nics_per_gpu: int = 1
    """NICs serving one GPU (their bandwidths add up)."""
    nvlink_gb_per_s: float = 400.0
    """Per-GPU NVLink bandwidth each way between GPUs of one node."""
    h2d_gb_per_s: float = 50.0
    """Host-to-device copy rate of one GPU (CPU-offloaded shards)."""
    prepare_gb_per_s: float = 1000.0
    """Packing copies and casts on one GPU, in bytes written."""
    quantize_gb_per_s: float = 500.0
    """FP8 block quantization on one GPU, in FP8 bytes produced."""
    barrier_s: float = 200e-6
    """Latency of one global barrier between mesh groups."""
    collective_latency_s: float = 30e-6
    """Fixed cost of one full_tensor() all-gather."""
    write_latency_s: float = 5e-6
    """Fixed cost of one posted batch of writes to one engine."""
    write_overhead_s: float = 0.0
    """Host time to post one write (one contiguous run) on a trainer rank. Posting is serial per
    rank and runs ahead of the link (the two pipeline: a batch's bytes finish no earlier than
    its last write was posted)."""
    task_overhead_s: float = 0.0
    """Host time to launch one task's preparation (gather, pack or quantize kernels) on the
    prepare stage; tasks whose writes all go straight from the shard pay nothing."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "nics_per_gpu":
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"Rates.nics_per_gpu must be an int >= 1, got {value!r}")
            elif f.name.endswith("_gb_per_s"):
                if not value > 0:
                    raise ValueError(f"Rates.{f.name} must be positive, got {value!r}")
            elif not value >= 0:
                raise ValueError(f"Rates.{f.name} must be >= 0, got {value!r}")

    @property
    def gpu_nic_bytes_per_s(self) -> float:
        """All NICs of one GPU together, bytes per second."""
        return self.nic_gb_per_s * self.nics_per_gpu * GB


def load_rates(path: str | Path, base: Rates | None = None) -> Rates:
    """`Rates` from a JSON object of field values (measured rates), over `base`.

    Raises:
        ValueError: not a JSON object, an unknown field (named), or a bad value.
    """
    data = json.loads(Path(path).read_text())
    return rates_from_mapping(data, base)


def rates_from_mapping(data: object, base: Rates | None = None) -> Rates:
    """`Rates` from a mapping of field values over `base` (see `load_rates`)."""
    if not isinstance(data, dict):
        raise ValueError("rates must be a JSON object of Rates fields")
    known = {f.name for f in dataclasses.fields(Rates)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown rate field(s) {unknown}; known: {sorted(known)}")
    for k, v in data.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"rate {k!r} must be a number, got {v!r}")
    return dataclasses.replace(base or Rates(), **data)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Spread:
    """Distribution of a per-resource quantity."""

    min: float
    median: float
    max: float
    mean: float

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        """Spread of `values` (zeros when empty)."""
        if not values:
            return Spread(min=0.0, median=0.0, max=0.0, mean=0.0)
        return Spread(
            min=float(min(values)), median=float(statistics.median(values)),
            max=float(max(values)), mean=float(sum(values) / len(values)),
        )

    @property
    def imbalance(self) -> float:
        """max / mean (1.0 is perfect balance)."""
        return self.max / self.mean if self.mean else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """What `simulate` predicts for one update."""

    predicted_s: float
    """Time from "go" until every write completed."""
    lower_bound_s: float
    """Busiest resource's work over its rate (no schedule can be faster)."""
    stage_bound_s: dict[str, float]
    """Busiest resource per stage: "trainer_nic", "engine_nic", "nvlink", "h2d", "prepare"."""
    bottleneck: str
    """The stage of the lower bound: the one to improve first."""
    busiest: dict[str, str]
    """Which rank or engine is the busiest of each stage."""
    trainer_nic_bytes: Spread
    """Bytes through each trainer GPU's NICs (writes and cross-node gathers)."""
    engine_nic_bytes: Spread
    """Bytes into each engine GPU's NICs."""
    total_write_bytes: int
    """Bytes written into engines."""
    num_tasks: int
    """Tasks over all ranks."""
    peak_memory_bytes: int
    """Largest temporary memory in flight on one rank."""
    stall_s: float
    """Longest time a rank waited for memory to be admitted."""

    @property
    def efficiency(self) -> float:
        """lower bound / predicted."""
        return self.lower_bound_s / self.predicted_s if self.predicted_s else 1.0


@dataclasses.dataclass(slots=True)
class _TaskCost:
    need: int
    scratch: int
    staging: int
    h2d_s: float
    gather_bytes: int  # bytes received per rank by the all-gather
    gather_nvlink: bool
    compute_s: float
    batches: list[tuple[str, int, int]]  # (engine, bytes, writes)
    group: int
    collective: int  # task_id when the task is a collective on > 1 rank, else -1
    mesh_size: int


def _task_costs(
    schedule: Schedule, sources: Sequence[SourceManifest], rates: Rates, hosts: Sequence[str]
) -> list[list[_TaskCost]]:
    sizes: dict[str, int] = {}
    local: dict[tuple[int, str], tuple[int, bool]] = {}
    for m in sources:
        for t in m.tensors:
            isz = dtype_size(t.dtype)
            sizes[t.name] = numel(t.shape) * isz
            if t.offloaded and t.local_box is not None:
                local[(m.rank, t.name)] = (numel(box_shape(t.local_box)) * isz, True)
    quant_rate = rates.quantize_gb_per_s * GB
    prep_rate = rates.prepare_gb_per_s * GB
    h2d_rate = rates.h2d_gb_per_s * GB
    out: list[list[_TaskCost]] = []
    for rs in schedule.ranks:
        costs = []
        for task in rs.tasks:
            compute = 0.0
            per_engine: dict[str, int] = defaultdict(int)
            runs: dict[str, int] = defaultdict(int)
            for w in task.writes:
                if isinstance(w, QuantWrite):
                    fp8 = sum(r.nbytes for r in w.weight_runs)
                    compute += fp8 / quant_rate
                    runs[w.engine] += len(w.weight_runs) + len(w.scale_runs)
                elif isinstance(w, SliceWrite):
                    if not w.zero_copy:
                        compute += w.nbytes / prep_rate
                    runs[w.engine] += len(w.runs)
                per_engine[w.engine] += w.nbytes
            if task.kind == "gather" or compute > 0:
                compute += rates.task_overhead_s
            h2d = task.h2d_bytes
            gather = 0
            n = len(task.mesh)
            if task.kind == "gather":
                total = sum(sizes.get(s, 0) for s in task.gather)
                gather = total * (n - 1) // n if n > 1 else 0
                h2d += sum(local.get((rs.rank, s), (0, False))[0] for s in task.gather)
            costs.append(
                _TaskCost(
                    need=task.staging_bytes + task.scratch_bytes,
                    scratch=task.scratch_bytes,
                    staging=task.staging_bytes,
                    h2d_s=h2d / h2d_rate,
                    gather_bytes=gather,
                    gather_nvlink=len({hosts[r] for r in task.mesh}) == 1,
                    compute_s=compute,
                    batches=[(e, n, runs[e]) for e, n in sorted(per_engine.items())],
                    group=task.mesh_group,
                    collective=task.task_id if task.kind == "gather" and n > 1 else -1,
                    mesh_size=n,
                )
            )
        out.append(costs)
    return out


def simulate(
    schedule: Schedule,
    sources: Sequence[SourceManifest],
    engine_hosts: Mapping[str, str],
    rates: Rates,
    *,
    memory_budget_bytes: int,
    progress: Callable[[str], None] | None = None,
) -> SimResult:
    """Predict one update of `schedule` (module docstring for the model).

    Args:
        schedule: the plan.
        sources: the trainer manifests the schedule was planned from (source sizes, offload,
            hosts).
        engine_hosts: engine name -> host (decides NVLink vs NIC).
        rates: link and stage rates.
        memory_budget_bytes: temporary memory per trainer rank.
        progress: called now and then with a short status line.

    Raises:
        ValueError: manifests that do not match the schedule (naming the rank or engine).
    """
    if memory_budget_bytes <= 0:
        raise ValueError("memory_budget_bytes must be positive")
    by_rank = {m.rank: m for m in sources}
    missing = [r for r in range(schedule.num_ranks) if r not in by_rank]
    if missing:
        raise ValueError(f"no source manifest for trainer rank(s) {missing[:10]}")
    unknown = [e for e in schedule.engines if e not in engine_hosts]
    if unknown:
        raise ValueError(f"no host for engine(s) {unknown[:10]}")
    hosts = [by_rank[r].host for r in range(schedule.num_ranks)]
    costs = _task_costs(schedule, sources, rates, hosts)
    world = schedule.num_ranks
    nic = rates.gpu_nic_bytes_per_s
    nvl = rates.nvlink_gb_per_s * GB

    # Resource clocks.
    send_free = [0.0] * world
    nvl_send_free = [0.0] * world
    recv_free: dict[str, float] = defaultdict(float)
    nvl_recv_free: dict[str, float] = defaultdict(float)
    host_free = [0.0] * world  # posting thread of each trainer rank
    post_cost = rates.write_overhead_s
    # Work totals for the lower bound.
    send_bytes = [0] * world
    nvl_bytes = [0] * world
    recv_bytes: dict[str, int] = defaultdict(int)
    h2d_total = [0.0] * world
    compute_total = [0.0] * world

    # Per-rank process state.
    n_tasks = [len(c) for c in costs]
    admitted = [0] * world
    prepared = [0] * world
    busy = [False] * world
    mem = [0] * world
    in_flight = [0] * world  # tasks admitted whose writes did not complete
    peak = [0] * world
    h2d_free = [0.0] * world
    h2d_end: list[dict[int, float]] = [{} for _ in range(world)]
    prep_free = [0.0] * world
    wait_since = [-1.0] * world
    stall = 0.0
    num_groups = max(1, schedule.num_mesh_groups)
    released = [0.0] + [-1.0] * (num_groups - 1)
    arrivals: list[dict[int, float]] = [dict() for _ in range(num_groups)]
    collectives: dict[int, dict[int, float]] = defaultdict(dict)
    done_time = 0.0

    events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, rank, task)
    seq = 0
    ADVANCE, PREP_DONE, WRITE_DONE = 0, 1, 2

    def push(t: float, kind: int, rank: int, idx: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, rank, idx))

    def reach(rank: int, upto_group: int, t: float) -> None:
        """Rank prepared everything before group `upto_group`: arrive at barriers <= it."""
        for g in range(1, min(upto_group, num_groups - 1) + 1):
            if rank not in arrivals[g]:
                arrivals[g][rank] = t
                if len(arrivals[g]) == world:
                    released[g] = max(arrivals[g].values()) + rates.barrier_s
                    for r in range(world):
                        push(released[g], ADVANCE, r, -1)

    def post(rank: int, c: _TaskCost, t: float) -> float:
        finish = t
        for engine, nbytes, nwrites in c.batches:
            # Posting: the link may start after the first write was posted, and the last bytes
            # leave no earlier than the last write was posted plus its share of the bytes.
            h_start = max(t, host_free[rank])
            h_end = h_start + nwrites * post_cost
            host_free[rank] = h_end
            ready = h_start + post_cost if nwrites else h_start
            last = nbytes / max(1, nwrites)  # bytes of the last write posted (mean size)
            if engine_hosts[engine] == hosts[rank]:
                start = max(ready, nvl_send_free[rank])
                s_end = max(start + nbytes / nvl, h_end + last / nvl)
                nvl_send_free[rank] = s_end
                r_end = max(max(start, nvl_recv_free[engine]) + nbytes / nvl, s_end)
                nvl_recv_free[engine] = r_end
                nvl_bytes[rank] += nbytes
            else:
                start = max(ready, send_free[rank])
                s_end = max(start + nbytes / nic, h_end + last / nic)
                send_free[rank] = s_end
                r_end = max(max(start, recv_free[engine]) + nbytes / nic, s_end)
                recv_free[engine] = r_end
                send_bytes[rank] += nbytes
                recv_bytes[engine] += nbytes
            finish = max(finish, s_end, r_end + rates.write_latency_s)
        return finish

    def start_prepare(ranks_start: Sequence[tuple[int, float]], idx_of: dict[int, int]) -> None:
        """Begin preparation of the given ranks' next task at the given start times."""
        for rank, start in ranks_start:
            c = costs[rank][idx_of[rank]]
            t = start
            if c.gather_bytes:
                if c.gather_nvlink:
                    t += c.gather_bytes / nvl
                    nvl_bytes[rank] += c.gather_bytes
                else:
                    t += c.gather_bytes / nic
                    send_free[rank] = max(send_free[rank], start) + c.gather_bytes / nic
                    send_bytes[rank] += c.gather_bytes
            t += c.compute_s
            compute_total[rank] += c.compute_s
            push(t, PREP_DONE, rank, idx_of[rank])

    def advance(rank: int, now: float) -> None:
        nonlocal stall
        # Admission, in order, bounded by memory and by the barrier of the task's group.
        while admitted[rank] < n_tasks[rank]:
            c = costs[rank][admitted[rank]]
            rel = released[c.group]
            if rel < 0 or rel > now:
                break
            if in_flight[rank] and mem[rank] + c.need > memory_budget_bytes:
                if wait_since[rank] < 0:
                    wait_since[rank] = now
                break
            if wait_since[rank] >= 0:
                stall = max(stall, now - wait_since[rank])
                wait_since[rank] = -1.0
            mem[rank] += c.need
            peak[rank] = max(peak[rank], mem[rank])
            in_flight[rank] += 1
            start = max(now, h2d_free[rank])
            h2d_free[rank] = start + c.h2d_s
            h2d_total[rank] += c.h2d_s
            h2d_end[rank][admitted[rank]] = h2d_free[rank]
            admitted[rank] += 1
        # Preparation, FIFO.
        if busy[rank] or prepared[rank] >= admitted[rank]:
            return
        idx = prepared[rank]
        c = costs[rank][idx]
        ready = max(h2d_end[rank][idx], prep_free[rank], now)
        busy[rank] = True
        if c.collective < 0:
            start_prepare([(rank, ready)], {rank: idx})
            return
        waiting = collectives[c.collective]
        waiting[rank] = ready
        if len(waiting) == c.mesh_size:
            start = max(waiting.values()) + rates.collective_latency_s
            members = list(waiting)
            del collectives[c.collective]
            start_prepare([(r, start) for r in members], {r: prepared[r] for r in members})

    for r in range(world):
        if n_tasks[r] == 0:
            reach(r, num_groups - 1, 0.0)
        else:
            reach(r, costs[r][0].group, 0.0)
        push(0.0, ADVANCE, r, -1)
    processed = 0
    while events:
        t, _, kind, rank, idx = heapq.heappop(events)
        processed += 1
        if progress is not None and processed % 200_000 == 0:
            progress(f"simulating: {processed} events, t={t:.3f} s")
        if kind == PREP_DONE:
            c = costs[rank][idx]
            busy[rank] = False
            prep_free[rank] = t
            prepared[rank] += 1
            mem[rank] -= c.scratch
            h2d_end[rank].pop(idx, None)
            finish = post(rank, c, t)
            push(finish, WRITE_DONE, rank, idx)
            nxt = prepared[rank]
            reach(rank, costs[rank][nxt].group if nxt < n_tasks[rank] else num_groups - 1, t)
        elif kind == WRITE_DONE:
            c = costs[rank][idx]
            mem[rank] -= c.staging
            in_flight[rank] -= 1
            done_time = max(done_time, t)
        advance(rank, t)
    stuck = [r for r in range(world) if prepared[r] < n_tasks[r]]
    if stuck:
        raise ValueError(
            f"simulation deadlocked: trainer rank(s) {stuck[:10]} never finished (collectives "
            "ordered differently on the ranks of one mesh?)"
        )
    engines = list(schedule.engines)
    engine_recv = [float(recv_bytes[e]) for e in engines]
    bounds = {
        "trainer_nic": max(send_bytes, default=0) / nic,
        "engine_nic": max(engine_recv, default=0.0) / nic,
        "nvlink": max(nvl_bytes, default=0) / nvl,
        "h2d": max(h2d_total, default=0.0),
        "prepare": max(compute_total, default=0.0),
    }
    busiest = {
        "trainer_nic": f"rank {max(range(world), key=send_bytes.__getitem__)}",
        "engine_nic": max(engines, key=lambda e: recv_bytes[e]) if engines else "-",
        "nvlink": f"rank {max(range(world), key=nvl_bytes.__getitem__)}",
        "h2d": f"rank {max(range(world), key=h2d_total.__getitem__)}",
        "prepare": f"rank {max(range(world), key=compute_total.__getitem__)}",
    }
    bottleneck = max(bounds, key=lambda k: bounds[k])
    return SimResult(
        predicted_s=done_time + rates.write_latency_s,  # the version words, last
        lower_bound_s=bounds[bottleneck],
        stage_bound_s=bounds,
        bottleneck=bottleneck,
        busiest=busiest,
        trainer_nic_bytes=Spread.of([float(b) for b in send_bytes]),
        engine_nic_bytes=Spread.of(engine_recv),
        total_write_bytes=sum(schedule.bytes_per_engine),
        num_tasks=sum(n_tasks),
        peak_memory_bytes=max(peak, default=0),
        stall_s=stall,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BaselineResult:
    """The rank-0 broadcast baseline (gather on rank 0, broadcast buckets, engines load)."""

    predicted_s: float
    """Pipelined time over all buckets."""
    gather_s: float
    """Rank 0 receiving the whole model."""
    broadcast_s: float
    """Rank 0's NIC sending the whole model once (ring/tree broadcast)."""
    load_s: float
    """Busiest engine rank copying and quantizing its share from the bucket."""
    num_buckets: int


def broadcast_baseline(
    model_bytes: int,
    engine_bytes: Sequence[int],
    rates: Rates,
    *,
    trainer_single_host: bool = False,
    fp8: bool = True,
    bucket_bytes: int = 1 << 30,
) -> BaselineResult:
    """What most RL frameworks do: every bucket of the model is gathered onto trainer rank 0,
    broadcast from it to every engine rank (one NIC carries all bytes), and each engine copies
    (and quantizes) its share into place. The three stages pipeline over buckets.

    Args:
        model_bytes: trainer bytes of one model copy.
        engine_bytes: bytes each engine rank holds.
        trainer_single_host: rank 0 gathers over NVLink (all trainer ranks on one host).
        fp8: engines quantize while loading.
    """
    if model_bytes < 0 or bucket_bytes <= 0:
        raise ValueError("model_bytes must be >= 0 and bucket_bytes positive")
    nic = rates.gpu_nic_bytes_per_s
    link = rates.nvlink_gb_per_s * GB if trainer_single_host else nic
    gather = model_bytes / link
    bcast = model_bytes / nic
    rate = (rates.quantize_gb_per_s if fp8 else rates.prepare_gb_per_s) * GB
    load = max(engine_bytes, default=0) / rate
    n = max(1, -(-model_bytes // bucket_bytes))
    stages = (gather, bcast, load)
    total = sum(s / n for s in stages) + (n - 1) * max(stages) / n
    return BaselineResult(
        predicted_s=total, gather_s=gather, broadcast_s=bcast, load_s=load, num_buckets=n
    )


__all__ = [
    "BaselineResult",
    "GB",
    "Rates",
    "SimResult",
    "Spread",
    "broadcast_baseline",
    "load_rates",
    "rates_from_mapping",
    "simulate",
]
