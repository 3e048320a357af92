"""`weight-transfer emulate`: a many-host cluster on one machine, measured against the simulator.

Every trainer rank and every engine rank of a cluster preset (`planner/presets/clusters.py`,
the ``emu-*`` presets are sized for it) runs as a process in a network namespace of its own
(`benchmarks/netns.py`): one host, one link shaped to a rate with `tc tbf` each way. The trainer
ranks hold seeded random weights as DTensor shards on the preset's FSDP/HSDP and expert meshes
(gloo over the shaped links, so mesh gathers cross them too); the engine ranks hold the vLLM
layout of the preset's engines (BF16 or FP8). Real updates run over the `tcp` backend (or `ucx`
on its tcp lane) and every one is verified bit-exactly (sha256 of every engine tensor against
`planner.reference.materialize` of the same seeded weights). Optionally the rank-0 funnel of
`bench update` runs on the same processes and links (gather every parameter, broadcast buckets
from trainer rank 0 over gloo, engines load with `apply_recipe`), also verified.

In the same run, before any update:
- the ceiling: a plain TCP socket transfer from trainer rank 0's host to engine 0's host (the
  payload rate one shaped link really carries) and the round-trip time of small messages;
- the CPU's copy and FP8-quantize rates (torch on this machine, under its current load).
These, and nothing from the updates, are the rates the simulator gets (`Rates`: NIC = the
ceiling, prepare = copy, quantize = quantize, latencies = RTT). The simulator replays the very
schedule the live controller planned. Each process reports its CPU time during the timed
updates, so a CPU-bound run shows as one.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
import resource
import secrets
import socket
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weight_transfer.benchmarks.netns import DEVICE, EmulatedCluster, LinkShape, enter_host
from weight_transfer.planner.presets.clusters import ClusterPreset

log = logging.getLogger(__name__)

CONTROL_PORT = 29_500
DIST_PORT = 29_501
BASELINE_PORT = 29_502
PROBE_PORT = 29_503
"""Ports inside the emulated hosts (fresh namespaces: nothing else listens there)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EmulateConfig:
    """What one emulated run does."""

    preset: ClusterPreset
    """Cluster: trainer and engine layout and model shape (every rank is a host)."""
    backend: str = "tcp"
    """Data-plane backend: "tcp", or "ucx" (forced onto UCX's tcp lane over the veth)."""
    rate_mbyte_per_s: float = 20.0
    """tbf rate of every host link, each way (10^6 bytes/s of frames)."""
    delay_ms: float = 0.0
    """netem one-way delay per link end (0: none)."""
    queue_ms: float = 200.0
    """tbf queue of every link end, in ms at the rate (packets beyond it are dropped)."""
    warmups: int = 1
    """Verified updates not timed."""
    repeats: int = 3
    """Timed (and verified) updates."""
    baseline: bool = False
    """Also run the rank-0 funnel (needs one FSDP mesh of all trainer ranks, no experts)."""
    baseline_repeats: int = 2
    """Timed funnel updates (after one untimed)."""
    bucket_bytes: int = 1 << 20
    """Funnel bucket (bench update uses 1 GiB for 16-60 GB models; 1 MiB for tens of MB)."""
    memory_budget_bytes: int = 64 << 20
    """Temporary memory per trainer rank."""
    ceiling_bytes: int = 0
    """Bytes of the socket ceiling transfer (0: 3 s worth at the shaped rate)."""
    timeout_s: float = 600.0
    """Limit of the whole run."""
    seed: int = 0
    """Seed of the weights."""
    cpu_share: float | None = None
    """Fraction of one core each emulated host's CPU stages (copy, FP8 quantize) get: the
    probed single-process rates are multiplied by it before the simulator sees them. The
    emulated hosts share this machine's cores, while the simulator gives every host its own
    CPU; None: cores / trainer ranks (at most 1), 1.0: each host has a core of its own."""
    delta_density: float = 0.0
    """Delta updates (docs/delta.md): each update flips the lowest bit of this fraction of every
    trainer tensor's elements, the sender runs in delta mode (the first, untimed, update is
    full), the engines apply their patches, and the simulator predicts a delta at this density
    (BF16 presets: the density of an FP8 engine's bytes is not this one). 0: full updates of
    new random weights."""
    dump_dir: str = ""
    """If set, every engine writes the raw bytes of each tensor after the last of our updates
    to ``<dump_dir>/<engine index>/<tensor name>.bin`` (for checks outside this module)."""

    def __post_init__(self) -> None:
        if self.backend not in ("tcp", "ucx"):
            raise ValueError(f"emulate runs the tcp or ucx backend, not {self.backend!r}")
        if self.cpu_share is not None and not 0 < self.cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {self.cpu_share}")
        if self.repeats < 1 or self.warmups < 0 or self.baseline_repeats < 1:
            raise ValueError("repeats and baseline_repeats must be >= 1, warmups >= 0")
        if self.preset.gpus_per_node != 1 or self.preset.shared_hosts:
            raise ValueError(
                f"preset {self.preset.name!r}: emulation gives every rank a host of its own "
                "(gpus_per_node=1, no shared hosts); use an emu-* preset or --gpus-per-node 1"
            )
        if self.baseline:
            reason = baseline_unsupported(self.preset)
            if reason:
                raise ValueError(reason)
        if not 0.0 <= self.delta_density <= 1.0:
            raise ValueError(f"delta_density must be in [0, 1], got {self.delta_density}")
        if self.delta_density and self.preset.engine.fp8:
            raise ValueError(
                f"preset {self.preset.name!r}: delta emulation runs BF16 engines (the FP8 "
                "bytes' density differs from the trainer's; use emu-dense or emu-moe)"
            )
        if self.delta_density and self.warmups < 1:
            raise ValueError("delta emulation needs warmups >= 1 (the first update is full)")

    @property
    def num_trainers(self) -> int:
        """Trainer ranks (hosts 0..n-1)."""
        return self.preset.trainer.num_gpus

    @property
    def num_engines(self) -> int:
        """Engine ranks (hosts n..n+m-1)."""
        return self.preset.engine.num_gpus


def planner_config(cfg: EmulateConfig) -> Any:
    """The planner's settings: the run's memory budget, writes of at most a quarter of it."""
    from weight_transfer.planner.plan import PlannerConfig

    return PlannerConfig(
        memory_budget_bytes=cfg.memory_budget_bytes,
        max_write_bytes=min(64 << 20, cfg.memory_budget_bytes // 4),
    )


def baseline_unsupported(preset: ClusterPreset) -> str | None:
    """Why the rank-0 funnel cannot run on `preset` (rank 0 must gather every parameter)."""
    from weight_transfer.planner.presets.clusters import get_shape

    t = preset.trainer
    if t.dense_shard_size != t.num_gpus or get_shape(preset.model).num_experts:
        return (
            f"preset {preset.name!r}: the rank-0 funnel needs one FSDP mesh of all trainer "
            "ranks and no experts (rank 0 gathers every parameter)"
        )
    return None


def _param(
    name: str, shape: Sequence[int], dtype: torch.dtype, seed: int, step: int
) -> torch.Tensor:
    """The seeded global value of trainer parameter `name` at update `step`."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 20) ^ (seed * 1_000_003 + step))
    return torch.randn(tuple(shape), generator=g).to(dtype)


def _value(
    cfg: EmulateConfig, name: str, shape: Sequence[int], dtype: torch.dtype, step: int
) -> torch.Tensor:
    """Trainer parameter `name` at update `step`: new random values each update, or in delta
    mode the step-0 values with the lowest bit of `delta_density` of the elements flipped at
    every step up to `step` (seeded per name and step, so every process computes the same)."""
    if not cfg.delta_density:
        return _param(name, shape, dtype, cfg.seed, step)
    t = _param(name, shape, dtype, cfg.seed, 0)
    ints = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 16) ^ (7919 * s + cfg.seed))
        mask = torch.rand(tuple(shape), generator=g) < cfg.delta_density
        ints[mask] ^= 1
    return t


def _transport(backend: str, ip: str) -> Any:
    from weight_transfer.backends.base import TransportConfig

    if backend == "ucx":
        return TransportConfig(
            name="ucx", listen_host=ip, options=(("TLS", "tcp"), ("NET_DEVICES", DEVICE))
        )
    return TransportConfig(name="tcp", listen_host=ip)


def _control(ip: str, token: str, timeout_s: float) -> Any:
    from weight_transfer.config import ControlPlaneConfig

    return ControlPlaneConfig(host=ip, port=CONTROL_PORT, token=token, timeout_s=timeout_s)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _enter(host: str) -> None:
    enter_host(host)
    os.environ["GLOO_SOCKET_IFNAME"] = DEVICE
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------------------------


def _meshes(cfg: EmulateConfig, rank: int) -> dict[tuple[int, ...], Any]:
    """DeviceMesh of each shard group the preset uses (made collectively on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    t = cfg.preset.trainer
    out: dict[tuple[int, ...], Any] = {}
    for size in sorted({t.dense_shard_size, t.expert_shard_size}):
        if size == 1:
            continue
        mesh = init_device_mesh("cpu", (t.num_gpus // size, size), mesh_dim_names=("rep", "shard"))
        g = rank // size
        out[tuple(range(g * size, (g + 1) * size))] = mesh["shard"]
    return out


def _gather_probe(meshes: dict[tuple[int, ...], Any], rank: int, repeats: int = 20) -> float | None:
    """Median time of one full_tensor() of a tiny DTensor, slowest of this rank's meshes (the
    fixed cost of a gather: gloo's ring steps, dispatch and process wake-ups), or None when the
    preset has no mesh of more than one rank. Collective: every rank runs it."""
    from torch.distributed.tensor import DTensor, Shard

    worst = None
    for ranks, mesh in sorted(meshes.items()):
        x = DTensor.from_local(
            torch.ones(1, 8),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size((len(ranks), 8)),
            stride=(8, 1),
        )
        times = []
        for i in range(repeats + 3):
            t = time.perf_counter()
            x.full_tensor()
            if i >= 3:
                times.append(time.perf_counter() - t)
        med = statistics.median(times)
        worst = med if worst is None else max(worst, med)
    return worst


def trainer_main(
    rank: int,
    cfg: EmulateConfig,
    hosts: list[str],
    ips: list[str],
    token: str,
    rates: dict[str, float],
    out: Any,
) -> None:
    """One trainer rank in its own host: DTensor shards, sender, timed and verified updates."""
    _enter(hosts[rank])
    _trainer(rank, cfg, ips, token, rates, out)


def _trainer(
    rank: int, cfg: EmulateConfig, ips: list[str], token: str, rates: dict[str, float], out: Any
) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from weight_transfer.config import DeltaConfig, SenderConfig, TransferConfig
    from weight_transfer.controller import Controller
    from weight_transfer.manifest import torch_dtype
    from weight_transfer.planner.delta import DeltaDensity
    from weight_transfer.planner.presets.clusters import dest_manifests, source_manifests
    from weight_transfer.planner.reference import materialize
    from weight_transfer.planner.simulate import rates_from_mapping, simulate
    from weight_transfer.sender import WeightSender, full_tensor

    n, m = cfg.num_trainers, cfg.num_engines
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{ips[0]}:{DIST_PORT}", rank=rank, world_size=n, timeout=timeout
    )
    try:
        meshes = _meshes(cfg, rank)
        mine = source_manifests(cfg.preset)[rank]
        locals_: dict[str, tuple[torch.Tensor, Any]] = {}
        params: dict[str, torch.Tensor] = {}
        for st in mine.tensors:
            dt = torch_dtype(st.dtype)
            box = st.local_box
            assert box is not None
            local = torch.empty(tuple(b - a for a, b in box), dtype=dt)
            if len(st.mesh) == 1:
                params[st.name] = local
            else:
                params[st.name] = DTensor.from_local(
                    local,
                    meshes[st.mesh],
                    [Shard(0)],
                    run_check=False,
                    shape=torch.Size(st.shape),
                    stride=torch.empty(st.shape, device="meta").stride(),
                )
            locals_[st.name] = (local, st)

        def fill(step: int) -> None:
            for local, st in locals_.values():
                box = st.local_box
                assert box is not None
                full = _value(cfg, st.name, st.shape, local.dtype, step)
                local.copy_(full[tuple(slice(a, b) for a, b in box)])

        def expected(step: int) -> dict[str, dict[str, torch.Tensor]]:
            full = {
                t.name: _value(cfg, t.name, t.shape, torch_dtype(t.dtype), step)
                for m0 in source_manifests(cfg.preset)
                for t in m0.tensors
            }
            return {
                d.engine: materialize(d.recipes, d.tensors, full)
                for d in dest_manifests(cfg.preset)
            }

        fill(0)
        gather_s = _gather_probe(meshes, rank)
        control = _control(ips[0], token, cfg.timeout_s)
        config = TransferConfig(
            num_engines=m,
            control=control,
            sender=SenderConfig(
                update_timeout_s=min(cfg.timeout_s, 300.0),
                delta=DeltaConfig(
                    enabled=cfg.delta_density > 0,
                    max_wire_fraction=1.0,  # measure the delta at this density, whatever it is
                    full_when_slower=False,  # and measure deltas even where they are slower
                    apply_timeout_s=min(cfg.timeout_s, 300.0),
                ),
            ),
            planner=planner_config(cfg),
        )
        # Made here, not by the sender: the simulator below reads its manifests and schedule.
        controller = Controller(config.controller_config(n), control) if rank == 0 else None
        sender = WeightSender(
            params,
            config,
            rank=rank,
            world_size=n,
            controller=controller,
            device="cpu",
            transport=_transport(cfg.backend, ips[rank]),  # this host's own address
        )
        if controller is not None:
            assert controller.schedule is not None
            sched = controller.schedule
            # The live manifests name this machine as every host; the emulated hosts are one
            # per rank (the planner ignores hosts, the simulator needs them).
            sources = [dataclasses.replace(s, host=f"trainer{s.rank}") for s in controller.sources]
            engine_hosts = {d.engine: f"engine{i}" for i, d in enumerate(controller.dests)}
            if gather_s is not None:
                # The fixed cost of one full_tensor() on these meshes, measured just now.
                rates = {**rates, "collective_latency_s": gather_s}
            rt = rates_from_mapping(rates)
            fifo = simulate(
                sched,
                sources,
                engine_hosts,
                rt,
                memory_budget_bytes=cfg.memory_budget_bytes,
                links="fifo",
            )
            r = simulate(
                sched,
                sources,
                engine_hosts,
                rt,
                memory_budget_bytes=cfg.memory_budget_bytes,
                links="fair",
            )
            tasks = [t for rs in sched.ranks for t in rs.tasks]
            delta_sim: dict[str, Any] = {}
            if cfg.delta_density:
                d = simulate(
                    sched,
                    sources,
                    engine_hosts,
                    rt,
                    memory_budget_bytes=cfg.memory_budget_bytes,
                    links="fair",
                    delta=DeltaDensity(other=cfg.delta_density, fp8=cfg.delta_density),
                )
                delta_sim = {
                    "predicted_delta_s": d.predicted_s,
                    "delta_write_bytes": d.total_write_bytes,
                    "delta_apply_s": d.apply_s,
                    "delta_bottleneck": d.bottleneck,
                    "delta_stage_bound_s": d.stage_bound_s,
                }
            out.put(
                (
                    "sim",
                    {
                        "predicted_s": r.predicted_s,
                        "predicted_fifo_s": fifo.predicted_s,
                        "lower_bound_s": r.lower_bound_s,
                        "bottleneck": r.bottleneck,
                        "stage_bound_s": r.stage_bound_s,
                        "busiest": r.busiest,
                        "total_write_bytes": r.total_write_bytes,
                        "num_tasks": r.num_tasks,
                        "gather_tasks": sum(1 for t in tasks if t.kind == "gather"),
                        "writes": sum(len(t.writes) for t in tasks),
                        "bytes_per_rank": list(sched.bytes_per_rank),
                        "bytes_per_engine": list(sched.bytes_per_engine),
                        "trainer_nic_bytes_max": r.trainer_nic_bytes.max,
                        "engine_nic_bytes_max": r.engine_nic_bytes.max,
                        "mesh_groups": sched.num_mesh_groups,
                        "fingerprint": sched.fingerprint[:16],
                        "gather_probe_s": gather_s,
                        "rates": rates,
                        **delta_sim,
                    },
                )
            )
        steps = cfg.warmups + cfg.repeats
        for step in range(1, steps + 1):
            fill(step)
            dist.barrier()
            c0, t0 = _cpu_s(), time.perf_counter()
            stats = sender.update(step)
            wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
            stages = _stage_seconds(stats.records)
            ds = sender.delta_stats
            delta = (ds.mode, ds.wire_bytes, ds.full_bytes, ds.encode_s) if ds else None
            out.put(("update", f"trainer{rank}", step, wall, stats.seconds, cpu, stages, delta))
            if controller is not None:
                bad = controller.verify(step, expected(step), cfg.timeout_s)
                out.put(("verified", "ours", step, bad))
        if cfg.baseline:
            _funnel_trainer(
                rank,
                cfg,
                ips,
                params,
                sorted(locals_),
                fill,
                expected,
                controller,
                full_tensor,
                out,
            )
        if controller is not None:
            sender._control.put("emulate/finished", _Finished(step=steps))
        dist.barrier()
        sender.close()
    finally:
        dist.destroy_process_group()


def _stage_seconds(records: Sequence[Any]) -> dict[str, float]:
    """Where one rank's update went: time preparing gather tasks and other tasks, and when the
    first write started and the last ended (seconds since the update started)."""
    gather = sum(r.prepare_end - r.prepare_start for r in records if r.kind == "gather")
    other = sum(r.prepare_end - r.prepare_start for r in records if r.kind != "gather")
    starts = [r.write_start for r in records if r.write_end > 0]
    ends = [r.write_end for r in records if r.write_end > 0]
    return {
        "prepare_gather_s": gather,
        "prepare_other_s": other,
        "first_write_s": min(starts, default=0.0),
        "last_write_s": max(ends, default=0.0),
        "last_prepare_s": max((r.prepare_end for r in records), default=0.0),
    }


@dataclasses.dataclass(frozen=True, slots=True)
class _Finished:
    step: int


def _funnel_pg(ips: list[str], rank: int, size: int, cfg: EmulateConfig) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore(
        ips[0],
        BASELINE_PORT,
        is_master=(rank == 0),  # type: ignore[attr-defined]  # not re-exported in torch's stubs
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        wait_for_workers=False,
    )
    return dist.ProcessGroupGloo(
        dist.PrefixStore("funnel/", store),
        rank,
        size,  # type: ignore[attr-defined]  # not re-exported in torch's stubs
        datetime.timedelta(seconds=cfg.timeout_s),
    )


def _funnel_step(i: int) -> int:
    """Data step of funnel update i (apart from ours, so a stale engine cannot pass)."""
    return 1000 + i


def _funnel_trainer(
    rank: int,
    cfg: EmulateConfig,
    ips: list[str],
    params: dict[str, torch.Tensor],
    names: list[str],
    fill: Callable[[int], None],
    expected: Callable[[int], dict[str, dict[str, torch.Tensor]]],
    controller: Any,
    full_tensor: Callable[..., torch.Tensor],
    out: Any,
) -> None:
    """`bench update`'s rank-0 funnel on the CPU: every rank gathers each parameter in order,
    rank 0 packs them into buckets and broadcasts each over gloo to every engine rank."""
    import torch.distributed as dist

    pg = _funnel_pg(ips, 0, 1 + cfg.num_engines, cfg) if rank == 0 else None
    bucket = torch.empty(cfg.bucket_bytes, dtype=torch.uint8)
    for i in range(cfg.baseline_repeats + 1):
        fill(_funnel_step(i))
        dist.barrier()
        c0, t0 = _cpu_s(), time.perf_counter()
        off = 0
        for name in names:
            full = full_tensor(params[name])
            if pg is None:
                continue
            t = full.contiguous().view(-1).view(torch.uint8)
            pos = 0
            while pos < t.numel():
                k = min(t.numel() - pos, cfg.bucket_bytes - off)
                bucket[off : off + k].copy_(t[pos : pos + k])
                off, pos = off + k, pos + k
                if off == cfg.bucket_bytes:
                    pg.broadcast(bucket, 0).wait()
                    off = 0
        if pg is not None:
            if off:
                pg.broadcast(bucket[:off], 0).wait()
            flag = torch.zeros(1, dtype=torch.int64)
            pg.allreduce([flag]).wait()  # every engine loaded everything
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        out.put(("funnel", f"trainer{rank}", i, wall, cpu))
        if controller is not None:
            bad = controller.verify(_funnel_step(i), expected(_funnel_step(i)), cfg.timeout_s)
            out.put(("verified", "funnel", i, bad))


def engine_main(
    index: int, cfg: EmulateConfig, hosts: list[str], ips: list[str], token: str, out: Any
) -> None:
    """One engine rank in its own host: seeded random tensors, receiver, digests per update."""
    _enter(hosts[cfg.num_trainers + index])
    _engine(index, cfg, ips, token, out)


def _engine(index: int, cfg: EmulateConfig, ips: list[str], token: str, out: Any) -> None:
    from weight_transfer.config import ReceiverConfig, TransferConfig
    from weight_transfer.manifest import torch_dtype
    from weight_transfer.planner.presets.clusters import dest_manifests, source_manifests
    from weight_transfer.receiver import WeightReceiver

    dm = dest_manifests(cfg.preset)[index]
    g = torch.Generator().manual_seed(90_000 + index)
    tensors = {
        t.name: torch.randn(t.shape, generator=g).to(torch_dtype(t.dtype)) for t in dm.tensors
    }  # random, never zeros: an unwritten byte shows
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rx = WeightReceiver(
        tensors,
        dm.recipes,
        TransferConfig(
            control=_control(ips[0], token, cfg.timeout_s),
            receiver=ReceiverConfig(
                patch_region_bytes=nbytes // 2 + (1 << 20) if cfg.delta_density else 0
            ),
        ),
        engine=dm.engine,
        transport=_transport(cfg.backend, ips[cfg.num_trainers + index]),  # its own address
    )
    try:
        steps = cfg.warmups + cfg.repeats
        c0, t0 = _cpu_s(), time.perf_counter()
        for step in range(1, steps + 1):
            # Waits for the commit; in delta mode also applies the patches (the engine's work).
            rx.apply_delta(step, cfg.timeout_s)
            c1, t1 = _cpu_s(), time.perf_counter()
            out.put(("engine_update", f"engine{index}", step, t1 - t0, c1 - c0))
            rx.publish_digests(step)
            c0, t0 = _cpu_s(), time.perf_counter()
        if cfg.dump_dir:
            folder = os.path.join(cfg.dump_dir, str(index))
            os.makedirs(folder, exist_ok=True)
            for name, t in tensors.items():
                t.contiguous().view(-1).view(torch.uint8).numpy().tofile(
                    os.path.join(folder, f"{name}.bin")
                )
        if cfg.baseline:
            _funnel_engine(index, cfg, ips, dm, tensors, source_manifests(cfg.preset)[0], rx, out)
        rx._control.get("emulate/finished", _Finished, cfg.timeout_s)
    finally:
        rx.close()


def _funnel_engine(
    index: int,
    cfg: EmulateConfig,
    ips: list[str],
    dm: Any,
    tensors: dict[str, torch.Tensor],
    src: Any,
    rx: Any,
    out: Any,
) -> None:
    """Receive the funnel's buckets and load them like an engine's load_weights."""
    from weight_transfer.manifest import torch_dtype
    from weight_transfer.planner.reference import apply_recipe

    pg = _funnel_pg(ips, 1 + index, 1 + cfg.num_engines, cfg)
    order = [
        (t.name, tuple(t.shape), torch_dtype(t.dtype))
        for t in sorted(src.tensors, key=lambda t: t.name)
    ]
    need: dict[str, list[Any]] = {}
    for r in dm.recipes:
        for p in r.parts:
            need.setdefault(p.source, []).append(r)
    spec = {t.name: t for t in dm.tensors}
    bucket = torch.empty(cfg.bucket_bytes, dtype=torch.uint8)
    total = sum(torch.Size(s).numel() * dt.itemsize for _, s, dt in order)
    for i in range(cfg.baseline_repeats + 1):
        c0, t0 = _cpu_s(), time.perf_counter()
        received: dict[str, torch.Tensor] = {}
        loaded: set[str] = set()
        pending: torch.Tensor | None = None
        cur, filled, done = 0, 0, 0
        while done < total:
            k = min(cfg.bucket_bytes, total - done)
            pg.broadcast(bucket[:k], 0).wait()
            pos = 0
            while pos < k:
                name, shape, dt = order[cur]
                if pending is None:
                    pending = torch.empty(shape, dtype=dt)
                dst = pending.view(-1).view(torch.uint8)
                take = min(dst.numel() - filled, k - pos)
                dst[filled : filled + take].copy_(bucket[pos : pos + take])
                filled, pos = filled + take, pos + take
                if filled == dst.numel():
                    received[name] = pending
                    pending, filled, cur = None, 0, cur + 1
            done += k
            for name in list(received):
                for r in need.get(name, []):
                    if r.dest in loaded or any(p.source not in received for p in r.parts):
                        continue
                    s = spec[r.dest]
                    apply_recipe(r, tuple(s.shape), torch_dtype(s.dtype), received, out=tensors)
                    loaded.add(r.dest)
            for name in list(received):
                if all(r.dest in loaded for r in need.get(name, [])):
                    del received[name]
        flag = torch.ones(1, dtype=torch.int64)
        pg.allreduce([flag]).wait()
        out.put(("funnel_engine", f"engine{index}", i, time.perf_counter() - t0, _cpu_s() - c0))
        rx.publish_digests(_funnel_step(i))


# ---------------------------------------------------------------------------------------------
# Ceiling and CPU rates
# ---------------------------------------------------------------------------------------------


def _probe_receiver(host: str, ip: str, nbytes: int, out: Any) -> None:
    _enter(host)
    srv = socket.create_server((ip, PROBE_PORT))
    srv.settimeout(60)
    out.put(("probe_ready",))
    conn, _ = srv.accept()
    conn.settimeout(60)
    # Round trips of small messages.
    rtts = []
    for _ in range(50):
        t = time.perf_counter()
        conn.sendall(b"p")
        if conn.recv(1) != b"p":
            raise RuntimeError("probe: bad echo")
        rtts.append(time.perf_counter() - t)
    buf = bytearray(1 << 20)
    got, t0 = 0, 0.0
    while got < nbytes:
        k = conn.recv_into(buf)
        if k == 0:
            raise RuntimeError(f"probe: connection closed after {got} of {nbytes} bytes")
        if got == 0:
            t0 = time.perf_counter()
        got += k
    t1 = time.perf_counter()
    conn.sendall(b"k")
    out.put(("probe", got, t1 - t0, statistics.median(rtts)))


def _probe_sender(host: str, ip: str, nbytes: int, out: Any) -> None:
    _enter(host)
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((ip, PROBE_PORT), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    for _ in range(50):
        conn.sendall(conn.recv(1))
    payload = secrets.token_bytes(1 << 20)
    sent = 0
    while sent < nbytes:
        k = min(len(payload), nbytes - sent)
        conn.sendall(payload[:k])
        sent += k
    conn.recv(1)
    conn.close()


def cpu_rates(repeats: int = 5, delta_density: float = 0.0) -> dict[str, float]:
    """This machine's copy (BF16 cast-free) and FP8 block-quantize rates, medians, GB/s; with
    a density, also the delta kernels' (`diff_gb_per_s`: bytes compared per second,
    `apply_gb_per_s`: patch bytes applied per second), on the CPU path the runtime uses."""
    from weight_transfer.kernels.delta import apply_changes, diff_encode, int_view, num_chunks
    from weight_transfer.planner.fp8 import quantize_fp8_blockwise

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    src = torch.randn(1536, 2048, generator=g).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy, quant = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        copy.append(src.numel() * src.element_size() / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        q, _s = quantize_fp8_blockwise(src, (128, 128))
        quant.append(q.numel() / (time.perf_counter() - t) / 1e9)
    out = {
        "prepare_gb_per_s": statistics.median(copy),
        "quantize_gb_per_s": statistics.median(quant),
    }
    if delta_density:
        new = src.clone().view(-1)
        a, b = int_view(new), int_view(src.view(-1))
        a[torch.rand(a.numel(), generator=g) < delta_density] ^= 1
        index = torch.empty(a.numel(), dtype=torch.int16)
        values = torch.empty(a.numel(), dtype=torch.int16)
        offsets = torch.empty(num_chunks(a.numel()) + 1, dtype=torch.int64)
        diff, apply = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            total = diff_encode(a, b, index=index, values=values, offsets=offsets)
            diff.append(a.numel() * 2 / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            apply_changes(dst.view(-1).view(torch.int16), offsets, index, values)
            patch = 8 * offsets.numel() + 4 * total
            apply.append(patch / (time.perf_counter() - t) / 1e9)
        out["diff_gb_per_s"] = statistics.median(diff)
        out["apply_gb_per_s"] = statistics.median(apply)
    return out


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else {}


def _machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def run(cfg: EmulateConfig, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build the emulated cluster, measure ceiling and CPU rates, run the updates, predict.

    Returns the whole result (what `emulate` writes as JSON). Namespaces are removed on return,
    on an exception, and at interpreter exit.
    """
    from weight_transfer.cli.launch import Child, Launch
    from weight_transfer.planner.presets.clusters import model_bytes, source_manifests
    from weight_transfer.planner.simulate import funnel_baseline, rates_from_mapping
    from weight_transfer.planner.types import dtype_size, numel

    say = progress or (lambda s: log.info("%s", s))
    n, m = cfg.num_trainers, cfg.num_engines
    shape = LinkShape(
        rate_mbyte_per_s=cfg.rate_mbyte_per_s, delay_ms=cfg.delay_ms, queue_latency_ms=cfg.queue_ms
    )
    t_start = time.monotonic()
    deadline = t_start + cfg.timeout_s
    load_before = os.getloadavg()
    with EmulatedCluster(n + m, shape) as cluster:
        hosts, ips = cluster.hosts, cluster.ips
        # 1. Ceiling: a plain socket transfer through two shaped links (trainer 0 -> engine 0).
        nbytes = cfg.ceiling_bytes or int(3 * cfg.rate_mbyte_per_s * 1e6)
        say(
            f"ceiling: {nbytes / 1e6:.0f} MB over one link pair at {cfg.rate_mbyte_per_s:g} "
            "MB/s "
            "tbf"
        )
        probe: dict[str, Any] = {}
        outcome = Launch(
            [
                Child("probe-rx", _probe_receiver, (hosts[n], ips[n], nbytes)),
                Child("probe-tx", _probe_sender, (hosts[0], ips[n], nbytes)),
            ]
        ).run(
            timeout_s=min(deadline, time.monotonic() + 120) - time.monotonic(),
            on_message=lambda _child, msg: probe.update(msg=msg) if msg[0] == "probe" else None,
        )
        if outcome.errors or "msg" not in probe:
            raise RuntimeError(f"ceiling probe failed: {outcome.errors or 'no report'}")
        _, got, secs, rtt = probe["msg"]
        ceiling = got / secs
        cpu = cpu_rates(delta_density=cfg.delta_density)
        share = cfg.cpu_share
        if share is None:
            share = min(1.0, (os.cpu_count() or 1) / n)
        rates = {
            "nic_gb_per_s": ceiling / 1e9,
            "nvlink_gb_per_s": ceiling / 1e9,
            "prepare_gb_per_s": cpu["prepare_gb_per_s"] * share,
            "quantize_gb_per_s": cpu["quantize_gb_per_s"] * share,
            "collective_latency_s": rtt,
            "write_latency_s": rtt / 2,
            "barrier_s": rtt,
        }
        if cfg.delta_density:
            rates["diff_gb_per_s"] = cpu["diff_gb_per_s"] * share
            rates["apply_gb_per_s"] = cpu["apply_gb_per_s"] * share
        say(
            f"ceiling {ceiling / 1e6:.2f} MB/s, rtt {rtt * 1e3:.3f} ms, copy "
            f"{cpu['prepare_gb_per_s']:.2f} GB/s, quantize {cpu['quantize_gb_per_s']:.3f} GB/s "
            f"(x {share:.3g} per host: the hosts share {os.cpu_count()} core(s))"
        )
        # 2. The cluster.
        token = secrets.token_hex(16)
        children = [
            Child(f"trainer{r}", trainer_main, (r, cfg, hosts, ips, token, rates)) for r in range(n)
        ] + [Child(f"engine{e}", engine_main, (e, cfg, hosts, ips, token)) for e in range(m)]
        say(f"starting {n} trainer and {m} engine processes ({cfg.preset.describe()})")
        msgs: list[tuple[Any, ...]] = []

        def handle(_child: str, got: list[Any]) -> None:
            msg = tuple(got)
            msgs.append(msg)
            if msg[0] == "update" and msg[1] == "trainer0":
                say(f"update {msg[2]}: {msg[3]:.3f} s")
            elif msg[0] == "funnel" and msg[1] == "trainer0":
                say(f"funnel {msg[2]}: {msg[3]:.3f} s")
            elif msg[0] == "sim":
                say(f"simulator: {msg[1]['predicted_s']:.3f} s ({msg[1]['bottleneck']})")

        outcome = Launch(children).run(
            timeout_s=deadline - time.monotonic(), grace_s=15.0, on_message=handle
        )
        errors = outcome.errors + [f"{name}: {tb}" for name, tb in outcome.tracebacks.items()]
        qdisc = cluster.qdisc_stats()
    load_after = os.getloadavg()
    # 3. Summary.
    sim = next((m_[1] for m_ in msgs if m_[0] == "sim"), None)
    first = cfg.warmups + 1
    ours = [x[3] for x in msgs if x[0] == "update" and x[1] == "trainer0" and x[2] >= first]
    executor = [x[4] for x in msgs if x[0] == "update" and x[1] == "trainer0" and x[2] >= first]
    cpu_use: dict[str, dict[str, float]] = {}
    for x in msgs:
        if x[0] == "update" and x[2] >= first:
            cpu_use.setdefault(x[1], {"cpu_s": 0.0, "wall_s": 0.0})
            cpu_use[x[1]]["cpu_s"] += x[5]
            cpu_use[x[1]]["wall_s"] += x[3]
        elif x[0] == "engine_update" and x[2] >= first:
            cpu_use.setdefault(x[1], {"cpu_s": 0.0, "wall_s": 0.0})
            cpu_use[x[1]]["cpu_s"] += x[4]
            cpu_use[x[1]]["wall_s"] += x[3]
    for v in cpu_use.values():
        v["cpu_fraction"] = v["cpu_s"] / v["wall_s"] if v["wall_s"] else 0.0
    verified = [
        {"kind": x[1], "step": x[2], "mismatches": list(x[3])} for x in msgs if x[0] == "verified"
    ]
    result: dict[str, Any] = {
        "preset": cfg.preset.name,
        "describe": cfg.preset.describe(),
        "backend": cfg.backend,
        "trainer_ranks": n,
        "engine_ranks": m,
        "link": {
            "tbf_mbyte_per_s": cfg.rate_mbyte_per_s,
            "delay_ms": cfg.delay_ms,
            "queue_ms": cfg.queue_ms,
            "burst_bytes": shape.burst_bytes,
        },
        "ceiling": {
            "bytes": got,
            "seconds": secs,
            "mbyte_per_s": ceiling / 1e6,
            "rtt_s": rtt,
            "of_tbf_rate": ceiling / (cfg.rate_mbyte_per_s * 1e6),
        },
        "cpu_rates": cpu,
        "cpu_share": share,
        "rates_fed_to_simulator": rates,
        "model_bytes": model_bytes(cfg.preset)[0],
        "warmups": cfg.warmups,
        "repeats": cfg.repeats,
        "measured_s": _spread(ours),
        "measured_all_s": ours,
        "executor_s": _spread(executor),
        "simulated": sim,
        "ratio_measured_over_predicted": (statistics.median(ours) / sim["predicted_s"])
        if ours and sim
        else None,
        "ratio_measured_over_predicted_fifo": (statistics.median(ours) / sim["predicted_fifo_s"])
        if ours and sim
        else None,
        "cpu_per_process": cpu_use,
        "verified": verified,
        "updates_raw": [list(x) for x in msgs if x[0] in ("update", "engine_update")],
        "all_verified": bool(verified) and all(not v["mismatches"] for v in verified),
        "namespaces": [cluster.switch, *hosts],
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "machine": _machine(),
        "errors": errors,
        "qdisc": qdisc,
        "wall_s": time.monotonic() - t_start,
    }
    if cfg.delta_density:
        timed = [x for x in msgs if x[0] == "update" and x[1] == "trainer0" and x[2] >= first]
        modes = [x[7][0] if x[7] else "full" for x in timed]
        wire = [x[7][1] / x[7][2] for x in timed if x[7] and x[7][0] == "delta"]
        pred = sim.get("predicted_delta_s") if sim else None
        result["delta"] = {
            "density": cfg.delta_density,
            "modes": modes,
            "wire_fraction": _spread(wire),
            "encode_s": _spread([x[7][3] for x in timed if x[7]]),
            "predicted_delta_s": pred,
            "predicted_full_s": sim["predicted_s"] if sim else None,
            "ratio_measured_over_predicted_delta": statistics.median(ours) / pred
            if ours and pred
            else None,
        }
    if cfg.baseline:
        fun = [x[3] for x in msgs if x[0] == "funnel" and x[1] == "trainer0" and x[2] >= 1]
        fcpu: dict[str, dict[str, float]] = {}
        for x in msgs:
            if x[0] in ("funnel", "funnel_engine") and x[2] >= 1:
                d = fcpu.setdefault(x[1], {"cpu_s": 0.0, "wall_s": 0.0})
                d["cpu_s"] += x[4]
                d["wall_s"] += x[3]
        for v in fcpu.values():
            v["cpu_fraction"] = v["cpu_s"] / v["wall_s"] if v["wall_s"] else 0.0
        src = source_manifests(cfg.preset)[0]
        pbytes = [
            numel(t.shape) * dtype_size(t.dtype) for t in sorted(src.tensors, key=lambda t: t.name)
        ]
        engine_bytes = sim["bytes_per_engine"] if sim else []
        pred = funnel_baseline(
            pbytes,
            n,
            engine_bytes,
            rates_from_mapping(rates),
            bucket_bytes=cfg.bucket_bytes,
            broadcast="binomial",
            fp8=cfg.preset.engine.fp8,
        )
        result["funnel"] = {
            "bucket_bytes": cfg.bucket_bytes,
            "measured_s": _spread(fun),
            "measured_all_s": fun,
            "predicted_s": pred.predicted_s,
            "gather_s": pred.gather_s,
            "broadcast_s": pred.broadcast_s,
            "load_s": pred.load_s,
            "num_buckets": pred.num_buckets,
            "ratio_measured_over_predicted": statistics.median(fun) / pred.predicted_s
            if fun
            else None,
            "cpu_per_process": fcpu,
        }
    return result


__all__ = [
    "EmulateConfig",
    "baseline_unsupported",
    "cpu_rates",
    "engine_main",
    "run",
    "trainer_main",
]
