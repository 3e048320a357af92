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
* Delta updates (`delta=DeltaDensity(...)`): every task still gathers (where the plan gathers:
  FP8 units split inside a block) and quantizes as above, then compares its engine bytes with
  the snapshot (`diff_gb_per_s`, zero-copy writes too) and
  writes one patch per engine whose size is `planner.delta.expected_wire_nbytes` of each write
  at the measured density (sparse or dense, whichever is smaller; FP8 scales at their own
  density). After the last write the engines apply their patches (`apply_gb_per_s` of patch
  bytes; the busiest engine's time is added) before the update counts as done. The trainer's
  snapshot advance after the commit (`SimResult.snapshot_advance_s`) is off this update's path.

The lower bound is the busiest resource: bytes over bandwidth of the busiest trainer NIC,
engine NIC and NVLink, and the busiest GPU's host-to-device and preparation time. The rank-0
broadcast baseline (`broadcast_baseline`) is modelled in closed form beside it.

The control plane ("go", the commit's two phases, the result reaching every member) is added
in closed form (`control_plane_s`) from measured round-trip, store and controller costs:
`SimResult.update_s` is the whole update.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from weight_transfer.planner.delta import DeltaDensity, expected_wire_nbytes
from weight_transfer.planner.types import (
    QuantWrite,
    Schedule,
    SliceWrite,
    SourceManifest,
    box_shape,
    dtype_size,
    numel,
    staging_key,
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
    control_rtt_s: float = 88e-6
    """One control-plane round trip between a member and the store (network and the store's
    reply). Default: measured on loopback of the shared 2-core CPU machine, 2026-12
    (`bench control-plane`, median of 2000); a fabric's TCP round trip replaces it."""
    control_request_s: float = 26e-6
    """Store CPU per request it serves, its wake-ups of waiting members included (one thread
    serves them all, in turn). Default: measured at 256 + 128 members (`bench control-plane`:
    the store process's CPU over the requests it served)."""
    control_message_s: float = 6.7e-6
    """Controller CPU per rank report it reads (authenticate, decrypt, decode). Default:
    measured (`bench control-plane`, median of 2000) after the decoder resolved each class's
    type hints once (2026-12-03; 57-76 us before, almost all of it resolving them)."""
    diff_gb_per_s: float = 1066.0
    """Delta updates: engine-format bytes one trainer GPU compares with its snapshot and
    encodes per second (reads both). Measured on one H200: 4 GiB of BF16 in 130 runs of
    Llama-3.1-8B tensor sizes at 0.78% changed, count + encode 4.03 ms median
    (`benchmarks/results/delta_h200_202612.md`, third round; one run of 4 GiB: 1255 GB/s)."""
    apply_gb_per_s: float = 64.0
    """Delta updates: patch bytes one engine GPU applies (scatters) per second. Measured on
    one H200, same runs: 67 MB of patch in 1.05 ms median (a scatter touches a 32-byte sector
    per changed element, so the rate is far below a copy's)."""

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
            min=float(min(values)),
            median=float(statistics.median(values)),
            max=float(max(values)),
            mean=float(sum(values) / len(values)),
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
    control_plane_s: float = 0.0
    """The update's control plane on its critical path (`control_plane_s`): "go", the two
    commit phases and the result reaching every member."""
    mode: str = "full"
    """"full", or "delta" when simulated with a `DeltaDensity`."""
    apply_s: float = 0.0
    """Delta: the busiest engine's patch apply (included in `predicted_s`)."""
    snapshot_advance_s: float = 0.0
    """Delta: the busiest trainer rank applying its patches to its snapshot after the commit
    (not in `predicted_s`: it overlaps whatever follows the update)."""
    full_write_bytes: int = 0
    """Delta: the bytes a full update of the same schedule would write."""

    @property
    def efficiency(self) -> float:
        """lower bound / predicted."""
        return self.lower_bound_s / self.predicted_s if self.predicted_s else 1.0

    @property
    def update_s(self) -> float:
        """The whole update as `WeightSender.update` returns it: data plane plus control plane."""
        return self.predicted_s + self.control_plane_s


REPORTS_PER_READ = 64
"""Rank reports the controller reads per request (`transfer.control._MULTI_GET_KEYS`)."""


def control_plane_s(num_trainer_ranks: int, num_engines: int, rates: Rates) -> float:
    """The control plane's share of one update's critical path (sum of `control_plane_phases`)."""
    return sum(control_plane_phases(num_trainer_ranks, num_engines, rates).values())


def control_plane_phases(
    num_trainer_ranks: int, num_engines: int, rates: Rates
) -> dict[str, float]:
    """The control plane's phases of one update on its critical path (`transfer.controller`).

    With n trainer ranks and m engines, h = rtt / 2 one way, r = the store's time per request,
    c = the controller's time per report:

    - go: rank 0 writes `go/k`; the store wakes the n - 1 waiting ranks and serves their reads
      (2 (n - 1) requests in turn): 4 h + 2 (n - 1) r for the last rank.
    - done, then committed (twice): the last rank's report reaches the store (h), which wakes
      the controller (h); the controller reads all reports, 64 per read, each read a wait and
      a multi_get (2 rtt, and the store serialises n values: n r), checks each (c), and writes
      its verdict, which wakes and serves every waiting member: the n - 1 ranks after done,
      the n - 1 ranks and m engines after committed (4 h + 2 (n - 1 [+ m]) r).

    The version words themselves are data-plane writes (`write_latency_s`). Work off the
    path (deletes, the watches' ends) is not counted.
    """
    n, m = num_trainer_ranks, num_engines
    if n < 1 or m < 0:
        raise ValueError("num_trainer_ranks must be >= 1 and num_engines >= 0")
    rtt, r, c = rates.control_rtt_s, rates.control_request_s, rates.control_message_s
    if n == 1:
        # One rank: no go, no reports to read; the result still reaches the engines.
        return {"go": 0.0, "done": 0.0, "committed": 2 * rtt + 2 * m * r}
    reads = -(-(n - 1) // REPORTS_PER_READ)
    phase = rtt + reads * 2 * rtt + n * r + (n - 1) * c
    return {
        "go": 2 * rtt + 2 * (n - 1) * r,
        "done": phase + 2 * rtt + 2 * (n - 1) * r,
        "committed": phase + 2 * rtt + 2 * (n - 1 + m) * r,
    }


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


def _write_cost(
    w: SliceWrite | QuantWrite, delta: DeltaDensity | None, rates: Rates
) -> tuple[int, float, int]:
    """(bytes on the wire, preparation seconds, writes posted) of one write."""
    quant_rate = rates.quantize_gb_per_s * GB
    prep_rate = rates.prepare_gb_per_s * GB
    if isinstance(w, QuantWrite):
        fp8 = sum(r.nbytes for r in w.weight_runs)
        scales = sum(r.nbytes for r in w.scale_runs)
        compute = fp8 / quant_rate
        if delta is None:
            return fp8 + scales, compute, len(w.weight_runs) + len(w.scale_runs)
        wire = expected_wire_nbytes(delta.fp8, fp8, 1) + expected_wire_nbytes(
            delta.scales, scales // 4, 4
        )
        return wire, compute + (fp8 + scales) / (rates.diff_gb_per_s * GB), 1
    compute = 0.0 if w.zero_copy else w.nbytes / prep_rate
    if delta is None:
        return w.nbytes, compute, len(w.runs)
    isz = dtype_size(w.dtype)
    wire = expected_wire_nbytes(delta.other, w.nbytes // isz, isz)
    return wire, compute + w.nbytes / (rates.diff_gb_per_s * GB), 1


def _diff_s(w: SliceWrite | QuantWrite, delta: DeltaDensity | None, rates: Rates) -> float:
    """The delta compare of one write's bytes (0 in a full update)."""
    if delta is None:
        return 0.0
    return w.nbytes / (rates.diff_gb_per_s * GB)


def _task_costs(
    schedule: Schedule,
    sources: Sequence[SourceManifest],
    rates: Rates,
    hosts: Sequence[str],
    delta: DeltaDensity | None = None,
) -> list[list[_TaskCost]]:
    sizes: dict[str, int] = {}
    local: dict[tuple[int, str], tuple[int, bool]] = {}
    for m in sources:
        for t in m.tensors:
            isz = dtype_size(t.dtype)
            sizes[t.name] = numel(t.shape) * isz
            if t.offloaded and t.local_box is not None:
                local[(m.rank, t.name)] = (numel(box_shape(t.local_box)) * isz, True)
    h2d_rate = rates.h2d_gb_per_s * GB
    out: list[list[_TaskCost]] = []
    for rs in schedule.ranks:
        costs = []
        for task in rs.tasks:
            compute = 0.0
            per_engine: dict[str, int] = defaultdict(int)
            runs: dict[str, int] = defaultdict(int)
            prepared: set[tuple[object, ...]] = set()
            for w in task.writes:
                wire, prep, nwrites = _write_cost(w, delta, rates)
                # Engine replicas receive the same bytes: the executor stages (and
                # quantizes) each distinct unit of a task once; a delta diffs each copy.
                key = staging_key(w)
                if key is not None:
                    if key in prepared:
                        prep = _diff_s(w, delta, rates)
                    prepared.add(key)
                compute += prep
                if delta is None:
                    runs[w.engine] += nwrites
                else:  # one patch write per engine and task
                    runs[w.engine] = 1
                per_engine[w.engine] += wire
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
    links: str = "fifo",
    delta: DeltaDensity | None = None,
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
        links: "fifo": a batch holds the sender's and then the receiver's link alone (two FIFO
            servers in tandem; fast at any scale). "fair": every batch is a flow, a cross-host
            gather
            is one flow per rank to the next rank of its ring ((n-1)/n of the tensors), and
            flows share each link max-min fairly (as TCP
            connections do), recomputed whenever a flow starts or ends; the trainer's receive
            side is a link too. Costs O(links x flows) per event: for small clusters.
        delta: simulate a delta update at these densities (module docstring) instead of a
            full one.

    Raises:
        ValueError: manifests that do not match the schedule (naming the rank or engine).
    """
    if memory_budget_bytes <= 0:
        raise ValueError("memory_budget_bytes must be positive")
    if links not in ("fifo", "fair"):
        raise ValueError(f"links must be 'fifo' or 'fair', got {links!r}")
    by_rank = {m.rank: m for m in sources}
    missing = [r for r in range(schedule.num_ranks) if r not in by_rank]
    if missing:
        raise ValueError(f"no source manifest for trainer rank(s) {missing[:10]}")
    unknown = [e for e in schedule.engines if e not in engine_hosts]
    if unknown:
        raise ValueError(f"no host for engine(s) {unknown[:10]}")
    hosts = [by_rank[r].host for r in range(schedule.num_ranks)]
    costs = _task_costs(schedule, sources, rates, hosts, delta)
    sim = _Simulation(
        schedule,
        costs,
        hosts,
        engine_hosts,
        rates,
        memory_budget_bytes,
        fair=links == "fair",
    )
    sim.run(progress)
    control = control_plane_s(schedule.num_ranks, len(schedule.engines), rates)
    result = dataclasses.replace(sim.result(), control_plane_s=control)
    if delta is None:
        return result
    patch_per_engine: dict[str, int] = defaultdict(int)
    patch_per_rank = [0] * schedule.num_ranks
    for rank, rank_costs in enumerate(costs):
        for c in rank_costs:
            for engine, nbytes, _ in c.batches:
                patch_per_engine[engine] += nbytes
                patch_per_rank[rank] += nbytes
    apply_rate = rates.apply_gb_per_s * GB
    apply_s = max(patch_per_engine.values(), default=0) / apply_rate
    return dataclasses.replace(
        result,
        predicted_s=result.predicted_s + apply_s,
        total_write_bytes=sum(patch_per_engine.values()),
        mode="delta",
        apply_s=apply_s,
        snapshot_advance_s=max(patch_per_rank, default=0) / apply_rate,
        full_write_bytes=sum(schedule.bytes_per_engine),
    )


_ADVANCE, _PREP_DONE, _WRITE_DONE, _FLOW_START = 0, 1, 2, 3
"""Event kinds: try to admit and prepare; a task's preparation ended; its writes completed; a
flow of the fair link model starts (its payload is in `_Simulation.starting`)."""

_INF = float("inf")


class _Fluid:
    """Flows sharing links max-min fairly (progressive filling), advanced in time."""

    def __init__(self) -> None:
        self.cap: dict[object, float] = {}
        self.flows: dict[int, list[Any]] = {}  # id -> [remaining bytes, rate, links, done]
        self.now = 0.0
        self.next_id = 0

    def advance(self, t: float) -> None:
        """Move every flow on to time `t`."""
        dt = t - self.now
        if dt > 0:
            for f in self.flows.values():
                f[0] = max(0.0, f[0] - f[1] * dt)
        self.now = max(self.now, t)

    def add(self, nbytes: float, links: tuple[object, ...], done: object) -> None:
        """Start a flow now (`advance` first); `done` comes back from `pop_done`."""
        self.flows[self.next_id] = [float(nbytes), 0.0, links, done]
        self.next_id += 1
        self.rebalance()

    def next_done(self) -> float:
        """When the first flow ends at the current rates."""
        best = _INF
        for rem, rate, _, _ in self.flows.values():
            if rate > 0:
                best = min(best, self.now + rem / rate)
        return best

    def pop_done(self) -> list[Any]:
        """Remove the flows that ended by now (a relative byte tolerance); their `done`s."""
        out = []
        for fid in list(self.flows):
            rem, rate, _, done = self.flows[fid]
            if rem <= 1e-9 * max(1.0, rate) or rem < 1e-3:
                out.append(done)
                del self.flows[fid]
        if out:
            self.rebalance()
        return out

    def rebalance(self) -> None:
        """Max-min fair rates: fill the tightest link first, freeze its flows, repeat."""
        left = {}
        users: dict[object, list[int]] = defaultdict(list)
        for fid, (_, _, links, _) in self.flows.items():
            for ln in links:
                users[ln].append(fid)
                left[ln] = self.cap[ln]
        frozen: set[int] = set()
        count = {ln: len(u) for ln, u in users.items()}
        while len(frozen) < len(self.flows):
            ln = min((x for x in count if count[x] > 0), key=lambda x: left[x] / count[x])
            share = left[ln] / count[ln]
            for fid in users[ln]:
                if fid in frozen:
                    continue
                frozen.add(fid)
                self.flows[fid][1] = share
                for other in self.flows[fid][2]:
                    left[other] -= share
                    count[other] -= 1


class _Simulation:
    """The discrete-event model of one update (module docstring), one method per step.

    Resource clocks (when each NIC, NVLink direction, host posting thread, copy engine and
    prepare stage is next free) and per-rank pipeline state advance through a heap of events.
    """

    def __init__(
        self,
        schedule: Schedule,
        costs: list[list[_TaskCost]],
        hosts: list[str],
        engine_hosts: Mapping[str, str],
        rates: Rates,
        memory_budget_bytes: int,
        fair: bool = False,
    ) -> None:
        world = schedule.num_ranks
        self.fair = fair
        self.fluid = _Fluid()
        self.starting: dict[int, tuple[float, tuple[object, ...], object]] = {}
        self.batches_left: dict[tuple[int, int], int] = {}
        self.task_finish: dict[tuple[int, int], float] = {}
        self.gathers_left: dict[int, int] = {}
        self.schedule, self.costs, self.hosts = schedule, costs, hosts
        self.engine_hosts, self.rates, self.budget = engine_hosts, rates, memory_budget_bytes
        self.world = world
        self.nic = rates.gpu_nic_bytes_per_s
        self.nvl = rates.nvlink_gb_per_s * GB
        # Resource clocks.
        self.send_free = [0.0] * world
        self.nvl_send_free = [0.0] * world
        self.recv_free: dict[str, float] = defaultdict(float)
        self.nvl_recv_free: dict[str, float] = defaultdict(float)
        self.host_free = [0.0] * world  # posting thread of each trainer rank
        # Work totals for the lower bound.
        self.send_bytes = [0] * world
        self.nvl_bytes = [0] * world
        self.recv_bytes: dict[str, int] = defaultdict(int)
        self.h2d_total = [0.0] * world
        self.compute_total = [0.0] * world
        # Per-rank pipeline state.
        self.n_tasks = [len(c) for c in costs]
        self.admitted = [0] * world
        self.prepared = [0] * world
        self.busy = [False] * world
        self.mem = [0] * world
        self.in_flight = [0] * world  # tasks admitted whose writes did not complete
        self.peak = [0] * world
        self.h2d_free = [0.0] * world
        self.h2d_end: list[dict[int, float]] = [{} for _ in range(world)]
        self.prep_free = [0.0] * world
        self.wait_since = [-1.0] * world
        self.stall = 0.0
        self.num_groups = max(1, schedule.num_mesh_groups)
        self.released = [0.0] + [-1.0] * (self.num_groups - 1)
        self.arrivals: list[dict[int, float]] = [dict() for _ in range(self.num_groups)]
        self.collectives: dict[int, dict[int, float]] = defaultdict(dict)
        self.done_time = 0.0
        self.events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, rank, task)
        self.seq = 0

    def push(self, t: float, kind: int, rank: int, idx: int) -> None:
        """Schedule an event."""
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, rank, idx))

    def reach(self, rank: int, upto_group: int, t: float) -> None:
        """Rank prepared everything before group `upto_group`: arrive at barriers <= it."""
        for g in range(1, min(upto_group, self.num_groups - 1) + 1):
            arrivals = self.arrivals[g]
            if rank not in arrivals:
                arrivals[rank] = t
                if len(arrivals) == self.world:
                    self.released[g] = max(arrivals.values()) + self.rates.barrier_s
                    for r in range(self.world):
                        self.push(self.released[g], _ADVANCE, r, -1)

    def flow(self, t: float, nbytes: float, links: tuple[object, ...], done: object) -> None:
        """Start a flow of the fair link model at `t` (an event, so it starts in order)."""
        for ln in links:
            self.fluid.cap.setdefault(ln, self.nvl if ln[0] in ("ntx", "nrx") else self.nic)  # type: ignore[index]
        self.seq += 1
        self.starting[self.seq] = (nbytes, links, done)
        heapq.heappush(self.events, (t, self.seq, _FLOW_START, -1, self.seq))

    def post_fair(self, rank: int, idx: int, c: _TaskCost, t: float) -> None:
        """Post a prepared task's batches as flows; WRITE_DONE when the last one ended."""
        post_cost = self.rates.write_overhead_s
        key = (rank, idx)
        self.batches_left[key] = 0
        self.task_finish[key] = t
        for engine, nbytes, nwrites in c.batches:
            h_start = max(t, self.host_free[rank])
            h_end = h_start + nwrites * post_cost
            self.host_free[rank] = h_end
            ready = h_start + post_cost if nwrites else h_start
            last = nbytes / max(1, nwrites)
            if self.engine_hosts[engine] == self.hosts[rank]:
                links: tuple[object, ...] = (("ntx", rank), ("nrx", engine))
                floor = h_end + last / self.nvl
                self.nvl_bytes[rank] += nbytes
            else:
                links = (("tx", rank), ("erx", engine))
                floor = h_end + last / self.nic
                self.send_bytes[rank] += nbytes
                self.recv_bytes[engine] += nbytes
            self.batches_left[key] += 1
            self.flow(ready, nbytes, links, ("write", rank, idx, floor))
        if not self.batches_left[key]:
            del self.batches_left[key]
            self.push(self.task_finish.pop(key), _WRITE_DONE, rank, idx)

    def flow_done(self, done: Any, t: float) -> None:
        """A flow of the fair model ended at `t`."""
        kind = done[0]
        if kind == "write":
            _, rank, idx, floor = done
            key = (rank, idx)
            self.task_finish[key] = max(self.task_finish[key], t, floor)
            self.batches_left[key] -= 1
            if not self.batches_left[key]:
                del self.batches_left[key]
                self.push(
                    self.task_finish.pop(key) + self.rates.write_latency_s, _WRITE_DONE, rank, idx
                )
        else:  # one ring step of a gather; the collective ends with its last one
            _, cid, members = done
            self.gathers_left[cid] -= 1
            if not self.gathers_left[cid]:
                del self.gathers_left[cid]
                for r in members:
                    c = self.costs[r][self.prepared[r]]
                    self.compute_total[r] += c.compute_s
                    self.push(t + c.compute_s, _PREP_DONE, r, self.prepared[r])

    def post(self, rank: int, c: _TaskCost, t: float) -> float:
        """Post a prepared task's write batches; when its last write completes."""
        post_cost, nic, nvl = self.rates.write_overhead_s, self.nic, self.nvl
        finish = t
        for engine, nbytes, nwrites in c.batches:
            # Posting: the link may start after the first write was posted, and the last bytes
            # leave no earlier than the last write was posted plus its share of the bytes.
            h_start = max(t, self.host_free[rank])
            h_end = h_start + nwrites * post_cost
            self.host_free[rank] = h_end
            ready = h_start + post_cost if nwrites else h_start
            last = nbytes / max(1, nwrites)  # bytes of the last write posted (mean size)
            if self.engine_hosts[engine] == self.hosts[rank]:
                start = max(ready, self.nvl_send_free[rank])
                s_end = max(start + nbytes / nvl, h_end + last / nvl)
                self.nvl_send_free[rank] = s_end
                r_end = max(max(start, self.nvl_recv_free[engine]) + nbytes / nvl, s_end)
                self.nvl_recv_free[engine] = r_end
                self.nvl_bytes[rank] += nbytes
            else:
                start = max(ready, self.send_free[rank])
                s_end = max(start + nbytes / nic, h_end + last / nic)
                self.send_free[rank] = s_end
                r_end = max(max(start, self.recv_free[engine]) + nbytes / nic, s_end)
                self.recv_free[engine] = r_end
                self.send_bytes[rank] += nbytes
                self.recv_bytes[engine] += nbytes
            finish = max(finish, s_end, r_end + self.rates.write_latency_s)
        return finish

    def start_prepare(self, ranks_start: Sequence[tuple[int, float]]) -> None:
        """Begin preparing each given rank's next task at the given start time."""
        if self.fair and len(ranks_start) > 1:
            r0 = ranks_start[0][0]
            c0 = self.costs[r0][self.prepared[r0]]
            if c0.gather_bytes and not c0.gather_nvlink:
                # A ring all-gather: rank i sends (n-1)/n of the tensor to rank i+1.
                members = sorted(r for r, _ in ranks_start)
                start = ranks_start[0][1]
                self.gathers_left[c0.collective] = len(members)
                for i, r in enumerate(members):
                    nxt = members[(i + 1) % len(members)]
                    self.send_bytes[r] += self.costs[r][self.prepared[r]].gather_bytes
                    self.flow(
                        start,
                        self.costs[r][self.prepared[r]].gather_bytes,
                        (("tx", r), ("rx", nxt)),
                        ("gather", c0.collective, tuple(members)),
                    )
                return
        for rank, start in ranks_start:
            idx = self.prepared[rank]
            c = self.costs[rank][idx]
            t = start
            if c.gather_bytes:
                if c.gather_nvlink:
                    t += c.gather_bytes / self.nvl
                    self.nvl_bytes[rank] += c.gather_bytes
                else:
                    t += c.gather_bytes / self.nic
                    self.send_free[rank] = (
                        max(self.send_free[rank], start) + c.gather_bytes / self.nic
                    )
                    self.send_bytes[rank] += c.gather_bytes
            t += c.compute_s
            self.compute_total[rank] += c.compute_s
            self.push(t, _PREP_DONE, rank, idx)

    def admit(self, rank: int, now: float) -> None:
        """Admit tasks in order, bounded by memory and by the barrier of the task's group."""
        while self.admitted[rank] < self.n_tasks[rank]:
            c = self.costs[rank][self.admitted[rank]]
            rel = self.released[c.group]
            if rel < 0 or rel > now:
                break
            if self.in_flight[rank] and self.mem[rank] + c.need > self.budget:
                if self.wait_since[rank] < 0:
                    self.wait_since[rank] = now
                break
            if self.wait_since[rank] >= 0:
                self.stall = max(self.stall, now - self.wait_since[rank])
                self.wait_since[rank] = -1.0
            self.mem[rank] += c.need
            self.peak[rank] = max(self.peak[rank], self.mem[rank])
            self.in_flight[rank] += 1
            start = max(now, self.h2d_free[rank])
            self.h2d_free[rank] = start + c.h2d_s
            self.h2d_total[rank] += c.h2d_s
            self.h2d_end[rank][self.admitted[rank]] = self.h2d_free[rank]
            self.admitted[rank] += 1

    def advance(self, rank: int, now: float) -> None:
        """Admit what fits, then start preparing the next task (FIFO), joining its collective."""
        self.admit(rank, now)
        if self.busy[rank] or self.prepared[rank] >= self.admitted[rank]:
            return
        idx = self.prepared[rank]
        c = self.costs[rank][idx]
        ready = max(self.h2d_end[rank][idx], self.prep_free[rank], now)
        self.busy[rank] = True
        if c.collective < 0:
            self.start_prepare([(rank, ready)])
            return
        waiting = self.collectives[c.collective]
        waiting[rank] = ready
        if len(waiting) == c.mesh_size:
            start = max(waiting.values()) + self.rates.collective_latency_s
            del self.collectives[c.collective]
            self.start_prepare([(r, start) for r in waiting])

    def on_prepared(self, rank: int, idx: int, t: float) -> None:
        """A task's preparation ended: free its scratch, post its writes, reach barriers."""
        c = self.costs[rank][idx]
        self.busy[rank] = False
        self.prep_free[rank] = t
        self.prepared[rank] += 1
        self.mem[rank] -= c.scratch
        self.h2d_end[rank].pop(idx, None)
        if self.fair:
            self.post_fair(rank, idx, c, t)
        else:
            self.push(self.post(rank, c, t), _WRITE_DONE, rank, idx)
        nxt = self.prepared[rank]
        group = self.costs[rank][nxt].group if nxt < self.n_tasks[rank] else self.num_groups - 1
        self.reach(rank, group, t)

    def on_written(self, rank: int, idx: int, t: float) -> None:
        """A task's writes completed: free its staging memory."""
        c = self.costs[rank][idx]
        self.mem[rank] -= c.staging
        self.in_flight[rank] -= 1
        self.done_time = max(self.done_time, t)

    def run(self, progress: Callable[[str], None] | None) -> None:
        """Process every event; raise if a rank never finished."""
        for r in range(self.world):
            first = self.costs[r][0].group if self.n_tasks[r] else self.num_groups - 1
            self.reach(r, first, 0.0)
            self.push(0.0, _ADVANCE, r, -1)
        processed = 0
        fluid = self.fluid
        while self.events or fluid.flows:
            if fluid.flows:
                t_flow = fluid.next_done()
                if not self.events or t_flow < self.events[0][0]:
                    if t_flow == _INF:
                        raise ValueError("simulation stalled: flows without bandwidth")
                    fluid.advance(t_flow)
                    for done in fluid.pop_done():
                        self.flow_done(done, t_flow)
                    continue
            t, _, kind, rank, idx = heapq.heappop(self.events)
            processed += 1
            if kind == _FLOW_START:
                fluid.advance(t)
                nbytes, links, done = self.starting.pop(idx)
                fluid.add(nbytes, links, done)
                continue
            if progress is not None and processed % 200_000 == 0:
                progress(f"simulating: {processed} events, t={t:.3f} s")
            if kind == _PREP_DONE:
                self.on_prepared(rank, idx, t)
            elif kind == _WRITE_DONE:
                self.on_written(rank, idx, t)
            self.advance(rank, t)
        stuck = [r for r in range(self.world) if self.prepared[r] < self.n_tasks[r]]
        if stuck:
            raise ValueError(
                f"simulation deadlocked: trainer rank(s) {stuck[:10]} never finished (collectives "
                "ordered differently on the ranks of one mesh?)"
            )

    def result(self) -> SimResult:
        """The prediction, the stage lower bounds and the balance of the finished run."""
        world, nic, nvl = self.world, self.nic, self.nvl
        engines = list(self.schedule.engines)
        engine_recv = [float(self.recv_bytes[e]) for e in engines]
        send, nvlb, h2d, comp = self.send_bytes, self.nvl_bytes, self.h2d_total, self.compute_total
        bounds = {
            "trainer_nic": max(send, default=0) / nic,
            "engine_nic": max(engine_recv, default=0.0) / nic,
            "nvlink": max(nvlb, default=0) / nvl,
            "h2d": max(h2d, default=0.0),
            "prepare": max(comp, default=0.0),
        }
        busiest = {
            "trainer_nic": f"rank {max(range(world), key=send.__getitem__)}",
            "engine_nic": max(engines, key=lambda e: self.recv_bytes[e]) if engines else "-",
            "nvlink": f"rank {max(range(world), key=nvlb.__getitem__)}",
            "h2d": f"rank {max(range(world), key=h2d.__getitem__)}",
            "prepare": f"rank {max(range(world), key=comp.__getitem__)}",
        }
        bottleneck = max(bounds, key=lambda k: bounds[k])
        return SimResult(
            predicted_s=self.done_time + self.rates.write_latency_s,  # the version words, last
            lower_bound_s=bounds[bottleneck],
            stage_bound_s=bounds,
            bottleneck=bottleneck,
            busiest=busiest,
            trainer_nic_bytes=Spread.of([float(b) for b in send]),
            engine_nic_bytes=Spread.of(engine_recv),
            total_write_bytes=sum(self.schedule.bytes_per_engine),
            num_tasks=sum(self.n_tasks),
            peak_memory_bytes=max(self.peak, default=0),
            stall_s=self.stall,
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


def binomial_broadcast_s(nbytes: float, participants: int, link_bytes_per_s: float) -> float:
    """Time of gloo's binomial-tree broadcast of `nbytes` to `participants` ranks (root included)
    on hosts of one link each (`gloo/broadcast.cc`).

    Virtual rank v receives from v with its highest set bit cleared, then queues its sends to
    v + 2^i for every bit i above that one at once (the root to every power of two). A rank's
    sends share its uplink, so all of them end ``k * nbytes / rate`` after it received (k its
    number of children); every rank receives from one parent only, so downlinks never contend.
    """
    if participants < 1 or link_bytes_per_s <= 0:
        raise ValueError("participants must be >= 1 and link_bytes_per_s positive")
    hop = nbytes / link_bytes_per_s
    done = [0.0] * participants
    for v in range(participants):
        low = v.bit_length()  # bits below this are v's own; children use bits from here up
        children = [
            v + (1 << i)
            for i in range(low, participants.bit_length() + 1)
            if v + (1 << i) < participants
        ]
        for c in children:
            done[c] = done[v] + len(children) * hop
    return max(done)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FunnelResult:
    """The rank-0 funnel as implemented by `bench update`'s baseline, over gloo or NCCL."""

    predicted_s: float
    """Whole baseline update."""
    gather_s: float
    """All-gathers of every parameter over the trainer ranks (rank 0's share of the time)."""
    broadcast_s: float
    """Rank 0 broadcasting every bucket to the engine ranks."""
    load_s: float
    """Busiest engine copying (quantizing) its share out of the buckets."""
    num_buckets: int


def funnel_baseline(
    param_bytes: Sequence[int],
    num_trainer_ranks: int,
    engine_bytes: Sequence[int],
    rates: Rates,
    *,
    bucket_bytes: int,
    broadcast: str = "binomial",
    overlap: bool = False,
    fp8: bool = False,
) -> FunnelResult:
    """The rank-0 funnel, per parameter and per bucket, as `bench update` runs it.

    Every trainer rank all-gathers each parameter (`full_tensor()` over the FSDP mesh of all
    `num_trainer_ranks`, one host each: a ring moves ``(n - 1) / n`` of it through every NIC, plus
    `collective_latency_s` per parameter); rank 0 packs the full tensors into buckets of
    `bucket_bytes` and broadcasts each to every engine rank; engines copy (or quantize) their
    share out of each bucket. This is where the funnel's cost grows with the trainer ranks (the
    gathers) while the broadcast stays on one NIC.

    Args:
        param_bytes: bytes of every trainer parameter, in send order.
        engine_bytes: bytes each engine rank holds.
        broadcast: "binomial" (gloo's tree, `binomial_broadcast_s`: rank 0's uplink carries
            ceil(log2 P) copies of every bucket, P = engines + 1) or "pipelined" (NCCL's ring or
            tree: the bucket leaves rank 0's NIC once).
        overlap: gathers, broadcasts and loads pipeline over buckets (NCCL streams); False
            when each call blocks (gloo on the CPU), so rank 0 gathers, then broadcasts.
    """
    if num_trainer_ranks < 1 or bucket_bytes <= 0:
        raise ValueError("num_trainer_ranks must be >= 1 and bucket_bytes positive")
    if broadcast not in ("binomial", "pipelined"):
        raise ValueError(f"broadcast must be 'binomial' or 'pipelined', got {broadcast!r}")
    nic = rates.gpu_nic_bytes_per_s
    n = num_trainer_ranks
    total = sum(param_bytes)
    gather = (
        sum((b * (n - 1) / n) / nic + rates.collective_latency_s for b in param_bytes)
        if n > 1
        else 0.0
    )
    buckets = [bucket_bytes] * (total // bucket_bytes)
    if total % bucket_bytes:
        buckets.append(total % bucket_bytes)
    participants = 1 + len(engine_bytes)
    if broadcast == "binomial":
        # Rank 0's broadcast returns once its own sends are done (its uplink carries one copy
        # per child); the engines' forwarding overlaps rank 0's next gather and bucket, so only
        # the last bucket's remaining tree depth is exposed.
        fanout = float(sum(1 for i in range(participants.bit_length()) if (1 << i) < participants))
        bcast = sum(fanout * b / nic + rates.write_latency_s for b in buckets)
        if buckets:
            last = buckets[-1]
            bcast += binomial_broadcast_s(last, participants, nic) - fanout * last / nic
    else:
        bcast = sum(b / nic + rates.write_latency_s for b in buckets)
    rate = (rates.quantize_gb_per_s if fp8 else rates.prepare_gb_per_s) * GB
    load = max(engine_bytes, default=0) / rate
    k = max(1, len(buckets))
    if overlap:
        stages = (gather, bcast, load)
        predicted = sum(s / k for s in stages) + (k - 1) * max(stages) / k
    else:
        # Rank 0 blocks in each gather and each broadcast; the engines load bucket i while
        # rank 0 gathers bucket i + 1, so only the last bucket's load is exposed.
        predicted = gather + bcast + load / k
    return FunnelResult(
        predicted_s=predicted,
        gather_s=gather,
        broadcast_s=bcast,
        load_s=load,
        num_buckets=len(buckets),
    )


__all__ = [
    "BaselineResult",
    "FunnelResult",
    "GB",
    "Rates",
    "SimResult",
    "Spread",
    "binomial_broadcast_s",
    "broadcast_baseline",
    "control_plane_phases",
    "control_plane_s",
    "funnel_baseline",
    "load_rates",
    "rates_from_mapping",
    "simulate",
]
