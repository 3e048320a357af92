"""`weight-transfer bench update`: whole updates on GPUs beside the ceiling and today's baseline.

Layouts:
- "split" (2 GPUs): one trainer rank (FSDP2, world 1) on GPU0 writes into one engine rank
  (tp=1) on GPU1, in another process.
- "colocated" (2 GPUs): FSDP2 over both GPUs (2 trainer processes) into an engine with tp=2 over
  both GPUs (2 more processes); every trainer rank sends.
- "one-gpu" (1 GPU): a trainer process (FSDP2, world 1) and an engine process on the same GPU,
  loopback over CUDA IPC: the colocated "hybrid engine" layout of verl and OpenRLHF.

Measured in one run, on the same weights:
- ours: the whole `WeightSender.update()` call on trainer rank 0 (prepare, writes, done,
  commit, version words), timed on the host after a synchronize; the executor's own time
  (`UpdateStats.seconds`, which ends before the commit) is the second column;
- ceiling: an in-process copy of the same bytes (split: GPU0 -> GPU1; one-gpu: GPU0 -> GPU0).
  For FP8 the ceiling counts the trainer bytes read S and the bytes written W at the copy's
  rate: t_copy(W) * (S + W) / (2 W) (a copy of W bytes reads W and writes W);
- offload: pinned host -> device of the same bytes;
- baseline (split only): what RL frameworks do today: trainer rank 0 packs HF tensors into 1 GiB
  buckets and NCCL-broadcasts them to a temporary buffer on each engine rank, which then copies
  (fuses, quantizes with the same GPU kernel) into its own parameters.
Every update (warm-ups and timed ones) runs on freshly perturbed weights and is verified: the
engine digests every tensor with `transfer.verify.keyed_digest` under a secret key the trainer
draws after the update, and the trainer compares with the same digest of the reference recipes
applied to its weights. Results go to JSON with min/median/max and the machine; a Perfetto
trace and a PNG timeline show the last update's stages.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import secrets
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from weight_transfer.backends.base import BACKENDS
from weight_transfer.config import DELTA_KERNELS

LAYOUTS = ("split", "colocated", "one-gpu")
_SLEEP_CYCLES = 400_000_000

NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchUpdateConfig:
    """What `bench update` runs."""

    preset: str = "llama-3.1-8b"
    """Model shape preset."""
    backend: str = "loopback"
    """Transport backend."""
    fp8: bool = False
    """Engine holds FP8 block-quantized linear weights."""
    offload: bool = False
    """Trainer parameters live in pinned host memory (FSDP2 CPUOffloadPolicy)."""
    layout: str = "split"
    """"split" (GPU0 -> GPU1), "colocated" (FSDP2 and tp=2 over both GPUs) or "one-gpu"
    (a trainer process and an engine process on GPU0, loopback over CUDA IPC)."""
    repeats: int = 5
    """Timed updates (after the warm-ups)."""
    warmups: int = 1
    """Untimed updates first (each verified too)."""
    layers: int = 0
    """Decoder layers of the preset to use (0: all); to fit two copies on one GPU."""
    no_sync: bool = False
    """Change the weights behind a long GPU kernel on the current stream and call `update()`
    at once, with no synchronize: checks that updates order themselves after the caller's
    stream (the times then include that kernel)."""
    memory_budget_bytes: int = 4 << 30
    """Per-rank temporary memory budget of our sender."""
    bucket_bytes: int = 1 << 30
    """Bucket size of the rank-0 broadcast baseline."""
    baseline: bool = True
    """Also measure the rank-0 NCCL broadcast baseline (split layout only: NCCL refuses two
    ranks of one communicator on one GPU, which the colocated layout would need)."""
    timeout_s: float = 500.0
    """Limit for the whole run."""
    json_path: str = "bench_update.json"
    """Where the results go."""
    trace_path: str = ""
    """Perfetto trace of the last timed update ("" for none)."""
    plot_path: str = ""
    """PNG timeline of that update ("" for none)."""
    profile_path: str = ""
    """Host profiles (cProfile, as text) of trainer rank 0's timed updates (this path +
    ".STEP") and of engine 0's `apply_delta` of them (+ ".engine.STEP"); "" for none."""
    transport_options: tuple[tuple[str, str], ...] = ()
    """Backend options."""
    delta_density: float = 0.0
    """Delta updates (docs/delta.md): before each update flip the lowest bit of this fraction
    of every trainer tensor's elements (the size of an RL step; a measured density goes here)
    and run the sender in delta mode; 0: full updates of freshly perturbed weights."""
    delta_anchor: int = 2
    """Delta mode: a full update every this many updates, so full and delta updates are timed
    in the same run on the same weights."""
    delta_full_when_slower: bool = False
    """Let delta mode fall back to full updates while deltas are slower (DeltaConfig's
    default); off by default here, so the benchmark measures the delta it asks for."""
    delta_snapshot: str = "device"
    """Delta mode: where the sender keeps its snapshot ("device" or "host")."""
    delta_kernels: str = "auto"
    """Delta mode: the GPU kernels of the senders and engines (`DeltaConfig.kernels`)."""
    patch_region_fraction: float = 0.25
    """Delta mode: each engine's patch region, as a fraction of its weight bytes."""
    table_quantize: bool = True
    """FP8 graph groups quantize through one table-kernel launch per block shape
    (`SenderConfig.table_quantize`); False: one kernel per call, for comparison."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.delta_density <= 1.0:
            raise ValueError("delta_density must be in [0, 1]")
        if self.delta_snapshot not in ("device", "host"):
            raise ValueError("delta_snapshot must be device or host")
        if self.delta_kernels not in DELTA_KERNELS:
            raise ValueError(f"delta_kernels must be one of {DELTA_KERNELS}")
        if not 0.0 < self.patch_region_fraction <= 1.0:
            raise ValueError("patch_region_fraction must be in (0, 1]")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a preset gives the benchmark: trainer tensors and each engine rank's layout."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    """Trainer tensors that are not bfloat16."""
    preset: str
    layers: int = 0

    def recipes(self, rank: int, tp: int, fp8: bool) -> Any:
        """Recipes of engine rank `rank` of `tp`."""
        if self.preset == "deepseek-v3-slice":
            from weight_transfer.planner.presets.deepseek import mla_recipes

            return mla_recipes(_mla_slice(), tp_rank=rank, tp_size=tp, fp8=fp8)
        from weight_transfer.planner.presets.vllm import vllm_recipes

        return vllm_recipes(_shape(self.preset, self.layers), rank, tp, fp8=fp8)

    def specs(self, rank: int, tp: int, fp8: bool) -> Any:
        """Engine tensors (name, shape, dtype) of that rank."""
        from weight_transfer.planner.recipes import engine_tensor_specs

        extra: dict[str, str] = {}
        if self.preset == "deepseek-v3-slice":
            from weight_transfer.planner.presets.deepseek import mla_engine_dtypes

            extra = mla_engine_dtypes(_mla_slice())
        return engine_tensor_specs(
            self.recipes(rank, tp, fp8), param_dtype="bfloat16", dtypes=extra
        )


def _mla_slice() -> Any:
    from weight_transfer.planner.presets.deepseek import MLA_SHAPES

    # Two real DeepSeek-V3 layers: a dense one and a MoE one (256 experts, shared expert).
    return dataclasses.replace(MLA_SHAPES["deepseek-v3"], num_layers=2, first_k_dense=1)


def _shape(preset: str, layers: int) -> Any:
    from weight_transfer.planner.presets.models import get_model_shape

    shape = get_model_shape(preset)
    return dataclasses.replace(shape, num_layers=layers) if layers else shape


def model_spec(preset: str, layers: int = 0) -> ModelSpec:
    """Shapes of a model preset (`planner.presets.models`, or "deepseek-v3-slice"), with only
    its first `layers` decoder layers when that is not 0."""
    if preset == "deepseek-v3-slice":
        from weight_transfer.planner.presets.deepseek import mla_parameter_shapes, mla_source_dtypes

        shape = _mla_slice()
        return ModelSpec(mla_parameter_shapes(shape), mla_source_dtypes(shape), preset)
    from weight_transfer.planner.presets.models import hf_parameter_shapes

    return ModelSpec(hf_parameter_shapes(_shape(preset, layers)), {}, preset, layers)


def param_module(
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    dtypes: dict[str, str] | None = None,
) -> nn.Module:
    """A module whose parameters carry the given dotted names (no forward)."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        dt = getattr(torch, (dtypes or {}).get(name, "")) if (dtypes or {}).get(name) else dtype
        m.register_parameter(
            leaf, nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)
        )
    return root


def _layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    return list(layers.children()) if layers is not None else []


def _n_trainers(cfg: BenchUpdateConfig) -> int:
    return 2 if cfg.layout == "colocated" else 1


def _n_engines(cfg: BenchUpdateConfig) -> int:
    return 2 if cfg.layout == "colocated" else 1


def _transfer_config(cfg: BenchUpdateConfig, control: Any, patch_region_bytes: int = 0) -> Any:
    """The run's `TransferConfig`: its backend and options, the one memory budget, delta mode
    (`patch_region_bytes`: the engine's patch region; the trainers ignore it)."""
    from weight_transfer.config import DeltaConfig, ReceiverConfig, SenderConfig, TransferConfig
    from weight_transfer.planner.plan import PlannerConfig

    return TransferConfig(
        transport=cfg.backend,
        transport_options=cfg.transport_options,
        num_engines=_n_engines(cfg),
        control=control,
        sender=SenderConfig(
            update_timeout_s=cfg.timeout_s,
            delta=DeltaConfig(
                enabled=cfg.delta_density > 0,
                anchor_every_updates=cfg.delta_anchor,
                max_wire_fraction=1.0,  # measure the delta at this density, whatever it is
                full_when_slower=cfg.delta_full_when_slower,
                snapshot_memory=cfg.delta_snapshot,
                apply_timeout_s=cfg.timeout_s,
                kernels=cfg.delta_kernels,
            ),
            table_quantize=cfg.table_quantize,
        ),
        receiver=ReceiverConfig(
            patch_region_bytes=patch_region_bytes, patch_kernels=cfg.delta_kernels
        ),
        planner=PlannerConfig(memory_budget_bytes=cfg.memory_budget_bytes),
    )


def _trainer_gpu(cfg: BenchUpdateConfig, rank: int) -> int:
    return rank


def _engine_gpu(cfg: BenchUpdateConfig, rank: int) -> int:
    return {"split": 1, "one-gpu": 0}.get(cfg.layout, rank)


def _quantize_into(
    x: torch.Tensor, block: tuple[int, int], out_q: torch.Tensor, out_scale: torch.Tensor
) -> None:
    """The Triton FP8 kernel (bit-identical to the reference quantizer) into given tensors."""
    from weight_transfer.kernels.fp8_triton import quantize_fp8

    quantize_fp8(x, block, out_q=out_q, out_scale=out_scale)


def _perturb(model: nn.Module, seed: int) -> None:
    from weight_transfer.manifest import local_part

    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = local_part(p)
            if local.numel():
                local.add_(float(torch.rand((), generator=g)) * 0.01)


def _perturb_sparse(model: nn.Module, seed: int, density: float) -> None:
    """Flip the lowest bit of a fraction `density` of every local shard's elements (what an
    RL step at a small learning rate does to bf16 weights), on their device."""
    from weight_transfer.manifest import local_part

    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            local = local_part(p)
            if not local.numel():
                continue
            g = torch.Generator(device=local.device).manual_seed(seed * 7919 + i)
            ints = local.view(torch.int16) if local.element_size() == 2 else local.view(torch.int32)
            mask = torch.rand(local.shape, generator=g, device=local.device) < density
            ints[mask] ^= 1


def _baseline_pg(store: Any, rank: int, size: int) -> Any:
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    return dist.ProcessGroupNCCL(dist.PrefixStore("baseline/", store), rank, size, opts)  # type: ignore[attr-defined]  # not re-exported in torch's stubs


def _bcast(pg: Any, t: torch.Tensor, root: int) -> None:
    import torch.distributed as dist

    o = dist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    pg.broadcast([t], o).wait()


def trainer_main(
    rank: int, cfg: BenchUpdateConfig, ports: dict[str, int], token: str, out: Any
) -> None:
    """Trainer rank: FSDP2 over the trainer GPUs, our updates, then the baseline broadcasts."""
    os.environ.update(NCCL_ENV)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from weight_transfer.config import ControlPlaneConfig
    from weight_transfer.controller import Controller
    from weight_transfer.sender import WeightSender

    gpu = _trainer_gpu(cfg, rank)
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    world = _n_trainers(cfg)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["dist"]))
    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world,
        device_id=dev,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    res: dict[str, Any] = {"rank": rank}
    try:
        spec = model_spec(cfg.preset, cfg.layers)
        shapes = spec.shapes
        mesh = init_device_mesh("cuda", (world,))
        # Build on the GPU (fast random init), then let FSDP2 shard (and offload) it.
        model = param_module(shapes, torch.bfloat16, dev, spec.dtypes)
        with torch.no_grad():
            g = torch.Generator(device=dev).manual_seed(1234 + rank)
            for p in model.parameters():
                p.normal_(generator=g)
        kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
        if cfg.offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in _layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base_mem = torch.cuda.memory_allocated(dev)
        nbytes_model = sum(p.numel() * p.element_size() for p in model.parameters())
        control = ControlPlaneConfig(port=ports["control"], token=token, timeout_s=cfg.timeout_s)
        config = _transfer_config(cfg, control)
        # Made here, not by the sender: the harness reads its schedule.
        controller = Controller(config.controller_config(world), control) if rank == 0 else None
        torch.cuda.reset_peak_memory_stats(dev)
        sender = WeightSender(
            model, config, rank=rank, world_size=world, controller=controller, device=dev
        )
        if controller is not None:
            assert controller.schedule is not None
            res["bytes_per_rank"] = list(controller.schedule.bytes_per_rank)
            res["bytes_per_engine"] = list(controller.schedule.bytes_per_engine)
            res["num_tasks"] = [len(r.tasks) for r in controller.schedule.ranks]
        update_s: list[float] = []
        executor_s: list[float] = []
        host: list[dict[str, float]] = []
        mismatches: list[str] = []
        res["verified_updates"] = 0
        step = 0
        for i in range(cfg.warmups + cfg.repeats):
            step += 1
            if cfg.no_sync:
                dist.barrier()
                torch.cuda.synchronize()
                torch.cuda._sleep(_SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # about 0.2 s
                _perturb(model, 1000 + step)  # queued behind it; update() must wait for it
            elif cfg.delta_density > 0:
                _perturb_sparse(model, 1000 + step, cfg.delta_density)
                dist.barrier()
                torch.cuda.synchronize()
            else:
                _perturb(model, 1000 + step)  # new weights for every update, off the clock
                dist.barrier()
                torch.cuda.synchronize()
            prof = _profiler(cfg, rank == 0 and i >= cfg.warmups)
            t0 = time.perf_counter()
            stats = sender.update(step)
            wall = time.perf_counter() - t0
            _write_profile(prof, f"{cfg.profile_path}.{step}")
            if i >= cfg.warmups:
                update_s.append(wall)
                executor_s.append(stats.seconds)
                host.append(_host_cost(stats))
                if sender.delta_stats is not None:
                    d = sender.delta_stats
                    res.setdefault("delta_updates", []).append(
                        {
                            "step": step,
                            "mode": d.mode,
                            "reason": d.reason,
                            "update_s": wall,
                            "wire_bytes": d.wire_bytes,
                            "full_bytes": d.full_bytes,
                            "num_segments": d.num_segments,
                            "encode_s": d.encode_s,
                            "apply_wait_s": d.apply_wait_s,
                        }
                    )
            res["update_bytes"] = stats.nbytes
            bad = _verify_update(cfg, spec, model, sender, rank, step, dev)
            mismatches += [f"step {step}: {m}" for m in bad]
            res["verified_updates"] += int(not bad)
        res["update_s"] = update_s
        res["executor_s"] = executor_s
        res["host"] = host
        res["num_writes"] = stats.num_writes
        res["mismatches"] = mismatches[:50]
        res["peak_extra_gpu_bytes"] = torch.cuda.max_memory_allocated(dev) - base_mem
        if sender._delta is not None and sender._delta.snapshot is not None:
            snap = sender._delta.snapshot.buffer
            res["snapshot_bytes"] = snap.numel()
            res["snapshot_device"] = str(snap.device)
            res["patch_staging_bytes"] = sum(
                s.builder.capacity + 64 for s in sender._delta.slots.values()
            )
        res["peak_staging_bytes"] = stats.peak_staging_bytes
        res["peak_scratch_bytes"] = stats.peak_scratch_bytes
        if cfg.trace_path and rank == 0:
            sender.write_trace(cfg.trace_path)
            res["records"] = [dataclasses.asdict(r) for r in stats.records]
        torch.cuda.empty_cache()
        dist.barrier()
        # Ceiling: in-process copy of the same bytes (split: GPU0 -> GPU1; one-gpu: GPU0 -> GPU0).
        if rank == 0 and cfg.layout in ("split", "one-gpu"):
            nb = res["update_bytes"]
            chunk = min(nb, 4 << 30)
            peer = 1 if cfg.layout == "split" else 0
            a = torch.empty(chunk, dtype=torch.uint8, device=dev).random_()
            b = torch.empty(chunk, dtype=torch.uint8, device=f"cuda:{peer}")
            ts = []
            for _ in range(6):
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(peer)
                t0 = time.perf_counter()
                left = nb
                while left > 0:
                    n = min(chunk, left)
                    b[:n].copy_(a[:n], non_blocking=True)
                    left -= n
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(peer)
                ts.append(time.perf_counter() - t0)
            res["copy_s"] = ts[1:]
            # Bytes the update must read from the trainer (the FP8 ceiling counts them too).
            res["source_bytes"] = _source_bytes(spec, cfg)
            # Pinned host -> device rate of the same bytes (the offload ceiling).
            h = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
            ts = []
            for _ in range(4):
                torch.cuda.synchronize(0)
                t0 = time.perf_counter()
                left = nb
                while left > 0:
                    n = min(chunk, left)
                    a[:n].copy_(h[:n], non_blocking=True)
                    left -= n
                torch.cuda.synchronize(0)
                ts.append(time.perf_counter() - t0)
            res["h2d_s"] = ts[1:]
            del a, b, h
        res["model_bytes"] = nbytes_model
        sender.close()
        if cfg.baseline and cfg.layout == "split":
            res.update(_baseline_trainer(cfg, rank, model, shapes, ports, dev))
        out.put(("trainer", rank, res))
    finally:
        dist.destroy_process_group()


def _profiler(cfg: BenchUpdateConfig, now: bool) -> Any:
    """A running cProfile when `--profile` is set and `now`, else None."""
    if not cfg.profile_path or not now:
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _write_profile(prof: Any, path: str) -> None:
    """Stop `prof` (None: nothing) and write its top functions, by cumulative and by own
    time, as text to `path`."""
    if prof is None:
        return
    import io
    import pstats

    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    with open(path, "w") as f:
        f.write(text.getvalue())


def _host_cost(stats: Any) -> dict[str, float]:
    """Host seconds of one update: posting (write stage) and issuing preparation (prepare
    stage), in total, per task and per write."""
    prep = sum(max(0.0, r.prepare_end - r.prepare_start) for r in stats.records)
    total = stats.post_seconds + prep
    return {
        "post_s": stats.post_seconds,
        "prepare_host_s": prep,
        "host_s": total,
        "per_task_us": total / max(1, stats.num_tasks) * 1e6,
        "per_write_us": total / max(1, stats.num_writes) * 1e6,
        "num_tasks": stats.num_tasks,
        "num_writes": stats.num_writes,
        **(dataclasses.asdict(stats.phases) if stats.phases is not None else {}),
    }


def _source_bytes(spec: ModelSpec, cfg: BenchUpdateConfig) -> int:
    """Bytes of the trainer tensors the engine recipes read (each read once)."""
    used = {
        p.source
        for e in range(_n_engines(cfg))
        for r in spec.recipes(e, _n_engines(cfg), cfg.fp8)
        for p in r.parts
    }
    total = 0
    for n in used:
        dt = getattr(torch, spec.dtypes.get(n, "bfloat16"))
        total += int(torch.Size(spec.shapes[n]).numel()) * dt.itemsize
    return total


def _verify_update(
    cfg: BenchUpdateConfig,
    spec: ModelSpec,
    model: nn.Module,
    sender: Any,
    rank: int,
    step: int,
    dev: torch.device,
) -> list[str]:
    """Compare every engine tensor after update `step` with the reference recipes applied to
    the trainer's weights, by a keyed digest under a fresh secret key (transfer.verify)."""
    from weight_transfer.manifest import local_part, torch_dtype
    from weight_transfer.protocol import Digests
    from weight_transfer.sender import full_tensor
    from weight_transfer.verify import expected_digests

    world = _n_trainers(cfg)
    with torch.no_grad():
        if world == 1:
            full = {n: local_part(p).to(dev) for n, p in model.named_parameters()}
        else:
            full = {n: full_tensor(p, dev) for n, p in model.named_parameters()}
    bad: list[str] = []
    if rank == 0:
        key = secrets.randbits(62)
        sender._control.put(
            f"vkey/{step}",
            Digests(engine="key", step=step, version=0, digests=(("key", str(key)),)),
        )
        tp = _n_engines(cfg)
        for e in range(tp):
            specs = spec.specs(e, tp, cfg.fp8)
            want = expected_digests(
                spec.recipes(e, tp, cfg.fp8),
                {s.name: (s.shape, torch_dtype(s.dtype)) for s in specs},
                full,
                key,
            )
            got = dict(
                sender._control.get(f"digest/{step}/engine{e}", Digests, cfg.timeout_s).digests
            )
            bad += [f"engine{e}:{n}" for n, v in want.items() if got.get(n) != f"{v[0]}:{v[1]}"]
            if len(want) != len(got):
                bad.append(f"engine{e}: {len(got)} tensors digested, {len(want)} expected")
    del full
    return bad


def _baseline_trainer(
    cfg: BenchUpdateConfig,
    rank: int,
    model: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    ports: dict[str, int],
    dev: torch.device,
) -> dict[str, Any]:
    """Rank-0 funnel: gather on rank 0, broadcast 1 GiB buckets to every engine rank."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        ports["baseline"],
        is_master=(rank == 0),
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        wait_for_workers=False,
    )  # type: ignore[attr-defined]  # not re-exported in torch's stubs
    size = 1 + _n_engines(cfg)
    from weight_transfer.sender import full_tensor

    names = list(shapes)
    params = dict(model.named_parameters())
    if rank != 0:
        # Other trainer ranks only join the gathers, in the same order.
        for _ in range(cfg.repeats + 1):
            for n in names:
                full_tensor(params[n], dev)
        return {}
    pg = _baseline_pg(store, 0, size)
    bucket = torch.empty(cfg.bucket_bytes, dtype=torch.uint8, device=dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    times = []
    for i in range(cfg.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        off = 0
        for n in names:
            t = full_tensor(params[n], dev).contiguous().view(-1).view(torch.uint8)
            pos = 0
            while pos < t.numel():
                k = min(t.numel() - pos, cfg.bucket_bytes - off)
                bucket[off : off + k].copy_(t[pos : pos + k])
                off += k
                pos += k
                if off == cfg.bucket_bytes:
                    _bcast(pg, bucket, 0)
                    off = 0
        if off:
            _bcast(pg, bucket[:off], 0)
        # Every engine reports that it loaded everything.
        _bcast(pg, flag, 1)
        torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - t0)
    return {"baseline_s": times}


def engine_main(
    rank: int, cfg: BenchUpdateConfig, ports: dict[str, int], token: str, out: Any
) -> None:
    """Engine rank: vLLM-layout tensors on its GPU, registered once; then the baseline."""
    os.environ.update(NCCL_ENV)
    from weight_transfer.config import ControlPlaneConfig
    from weight_transfer.manifest import torch_dtype
    from weight_transfer.protocol import Digests
    from weight_transfer.receiver import WeightReceiver
    from weight_transfer.verify import engine_digests

    gpu = _engine_gpu(cfg, rank)
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    spec = model_spec(cfg.preset, cfg.layers)
    tp = _n_engines(cfg)
    recipes = spec.recipes(rank, tp, cfg.fp8)
    specs = spec.specs(rank, tp, cfg.fp8)
    g = torch.Generator(device=dev).manual_seed(5 + rank)
    tensors = {}
    for s in specs:
        t = torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=dev)
        t.view(torch.uint8).random_(generator=g) if t.element_size() == 1 else t.normal_(
            generator=g
        )
        tensors[s.name] = t
    torch.cuda.synchronize()
    control = ControlPlaneConfig(port=ports["control"], token=token, timeout_s=cfg.timeout_s)
    engine_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    patch_bytes = (
        int(cfg.patch_region_fraction * engine_bytes) + (1 << 20) if cfg.delta_density else 0
    )
    config = _transfer_config(cfg, control, patch_region_bytes=patch_bytes)
    rx = WeightReceiver(
        tensors,
        recipes,
        config,
        engine=f"engine{rank}",
        transport=config.transport_config(device_index=gpu),
    )
    apply_s: list[float] = []
    wait_apply_s: list[float] = []
    for step in range(1, cfg.warmups + cfg.repeats + 1):
        # Every update is checked: digest every tensor under the key the trainer draws
        # after the update, once this step's version is committed (and, in delta mode,
        # its patches applied: the engine's per-update work, timed).
        prof = _profiler(cfg, rank == 0 and step > cfg.warmups)
        t_apply = time.perf_counter()
        applied = rx.apply_delta(step, cfg.timeout_s)
        _write_profile(prof, f"{cfg.profile_path}.engine.{step}")
        if applied.num_slots:
            # The apply alone (checks, kernels, sync), and the call as the engine sees it:
            # its wait for the update included (the trainer's whole update and whatever ran
            # between updates).
            apply_s.append(applied.apply_s)
            wait_apply_s.append(time.perf_counter() - t_apply)
        key = int(dict(rx._control.get(f"vkey/{step}", Digests, cfg.timeout_s).digests)["key"])
        torch.cuda.synchronize()
        got = {n: f"{a}:{b}" for n, (a, b) in engine_digests(tensors, key).items()}
        rx._control.put(
            f"digest/{step}/engine{rank}",
            Digests(
                engine=f"engine{rank}",
                step=step,
                version=rx.version,
                digests=tuple(sorted(got.items())),
            ),
        )
    res: dict[str, Any] = {
        "rank": rank,
        "engine_bytes": engine_bytes,
        "patch_region_bytes": patch_bytes,
        "apply_s": apply_s,
        "wait_apply_s": wait_apply_s,
    }
    if cfg.baseline and cfg.layout == "split":
        res.update(_baseline_engine(cfg, rank, spec, recipes, specs, tensors, ports, dev))
    rx.close()
    out.put(("engine", rank, res))


def _baseline_engine(
    cfg: BenchUpdateConfig,
    rank: int,
    spec: ModelSpec,
    recipes: Any,
    specs: Any,
    tensors: dict[str, torch.Tensor],
    ports: dict[str, int],
    dev: torch.device,
) -> dict[str, Any]:
    import torch.distributed as dist

    from weight_transfer.planner.reference import apply_recipe

    store = dist.TCPStore(
        "127.0.0.1",
        ports["baseline"],
        is_master=False,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        wait_for_workers=False,
    )  # type: ignore[attr-defined]  # not re-exported in torch's stubs
    pg = _baseline_pg(store, 1 + rank, 1 + _n_engines(cfg))
    shapes = spec.shapes
    names = list(shapes)
    src_dtype = {n: getattr(torch, spec.dtypes.get(n, "bfloat16")) for n in names}
    need: dict[str, list[Any]] = {}
    for r in recipes:
        for p in r.parts:
            need.setdefault(p.source, []).append(r)
    spec_of = {s.name: s for s in specs}
    bucket = torch.empty(cfg.bucket_bytes, dtype=torch.uint8, device=dev)
    flag = torch.ones(1, dtype=torch.int64, device=dev)
    from weight_transfer.manifest import torch_dtype

    for _ in range(cfg.repeats + 1):
        received: dict[str, torch.Tensor] = {}
        pending: dict[str, torch.Tensor] = {}
        order = [(n, int(torch.Size(shapes[n]).numel()) * src_dtype[n].itemsize) for n in names]
        cursor = [0, 0]  # tensor index, byte offset within it
        total = sum(nb for _, nb in order)
        done_bytes = 0
        loaded: set[str] = set()

        def load_ready(
            received: dict[str, torch.Tensor] = received,
            loaded: set[str] = loaded,
            pending: dict[str, torch.Tensor] = pending,
        ) -> None:
            # Like an engine's load_weights: build each parameter once all its sources arrived.
            for n in list(received):
                for r in need.get(n, []):
                    if r.dest in loaded or any(p.source not in received for p in r.parts):
                        continue
                    s = spec_of[r.dest]
                    # Like an engine's loader: straight into its parameters, FP8 with the kernel.
                    apply_recipe(
                        r,
                        s.shape,
                        torch_dtype(s.dtype),
                        received,
                        out=tensors,
                        quantize=_quantize_into,
                    )
                    loaded.add(r.dest)
            # Free sources whose every recipe is loaded (engines stream their load like this).
            for n in list(received):
                if all(r.dest in loaded for r in need.get(n, [])):
                    del received[n]
                    pending.pop(n, None)

        while done_bytes < total:
            n = min(cfg.bucket_bytes, total - done_bytes)
            _bcast(pg, bucket[:n], 0)
            pos = 0
            while pos < n:
                name, nb = order[cursor[0]]
                if name not in pending:
                    pending[name] = torch.empty(shapes[name], dtype=src_dtype[name], device=dev)
                dst = pending[name].view(-1).view(torch.uint8)
                k = min(nb - cursor[1], n - pos)
                dst[cursor[1] : cursor[1] + k].copy_(bucket[pos : pos + k])
                cursor[1] += k
                pos += k
                if cursor[1] == dst.numel():
                    received[name] = pending[name]
                    cursor[0] += 1
                    cursor[1] = 0
            done_bytes += n
            load_ready()
        load_ready()
        torch.cuda.synchronize()
        if rank == 0:
            _bcast(pg, flag, 1)
        else:
            _bcast(pg, flag, 1)
        received = {}
    return {}


def run(cfg: BenchUpdateConfig) -> dict[str, Any]:
    """Run the benchmark; returns (and writes) the results."""
    from weight_transfer.cli.launch import Child, Launch
    from weight_transfer.cli.run_demo import free_port

    ports = {"dist": free_port(), "control": free_port(), "baseline": free_port()}
    token = secrets.token_hex(16)
    children = [
        Child(f"trainer{r}", trainer_main, (r, cfg, ports, token)) for r in range(_n_trainers(cfg))
    ] + [Child(f"engine{e}", engine_main, (e, cfg, ports, token)) for e in range(_n_engines(cfg))]
    results: dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "errors": [],
        "machine": _machine(),
    }

    def on_message(_child: str, msg: Any) -> None:
        results[f"{msg[0]}{msg[1]}"] = msg[2]  # ("trainer" | "engine", rank, results)

    outcome = Launch(children).run(
        timeout_s=cfg.timeout_s + 60, grace_s=30.0, on_message=on_message
    )
    results["errors"] += outcome.errors
    results["errors"] += [f"{name}: {tb}" for name, tb in outcome.tracebacks.items()]
    results["exit_codes"] = outcome.exit_codes
    _summarize(results, cfg)
    with open(cfg.json_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    if cfg.plot_path and "trainer0" in results and results["trainer0"].get("records"):
        plot_timeline(
            results["trainer0"]["records"],
            cfg.plot_path,
            title=f"{cfg.preset} {'FP8' if cfg.fp8 else 'BF16'} {cfg.backend}",
        )
    return results


def _machine() -> dict[str, Any]:
    import platform

    out: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def _summarize(res: dict[str, Any], cfg: BenchUpdateConfig) -> None:
    """Headline: the whole `sender.update()` call (executor time beside it); ratios to the
    ceiling of the same run. Ceiling (same GPU or peer copy, D2D rate r = 2B/t_copy(B)):
    t_ceiling = (S + W) / r = t_copy(W) * (S + W) / (2 W), with W the bytes written to the
    engine and S the trainer bytes read; for BF16 S = W, so it is t_copy(W)."""
    t0 = res.get("trainer0", {})
    ours = _median(t0.get("update_s", []))
    nbytes = t0.get("update_bytes", 0)
    s: dict[str, Any] = {
        "machine": res.get("machine"),
        "update_s": _spread(t0.get("update_s", [])),
        "executor_s": _spread(t0.get("executor_s", [])),
        "bytes_written": nbytes,
        "update_gbps": nbytes / ours / 1e9 if ours == ours and ours > 0 else None,
    }
    if "copy_s" in t0 and nbytes:
        copy = _spread(t0["copy_s"])
        src = t0.get("source_bytes", nbytes)
        factor = (src + nbytes) / (2 * nbytes) if cfg.fp8 else 1.0
        s["copy_s"] = copy
        s["source_bytes"] = src
        s["ceiling_formula"] = "t_copy(W) * (S + W) / (2 W)" if cfg.fp8 else "t_copy(W)"
        s["ceiling_s"] = copy["median"] * factor
        s["ratio_to_ceiling"] = ours / s["ceiling_s"]
        s["ratio_to_ceiling_executor"] = _median(t0.get("executor_s", [])) / s["ceiling_s"]
    if "h2d_s" in t0:
        h = _spread(t0["h2d_s"])
        s["h2d_s"] = h
        s["ratio_to_h2d"] = ours / h["median"]
    if "baseline_s" in t0:
        b = _spread(t0["baseline_s"])
        s["baseline_s"] = b
        s["speedup_vs_baseline"] = b["median"] / ours
    hosts = t0.get("host", [])
    if hosts:
        s["host"] = {k: statistics.median(h[k] for h in hosts) for k in hosts[0]}
    s["peak_extra_gpu_bytes"] = t0.get("peak_extra_gpu_bytes")
    s["memory_budget_bytes"] = cfg.memory_budget_bytes
    s["verified_updates"] = t0.get("verified_updates", 0)
    s["updates"] = cfg.warmups + cfg.repeats
    s["verified"] = (
        not t0.get("mismatches") and s["verified_updates"] == s["updates"] and not res["errors"]
    )
    s["mismatches"] = (t0.get("mismatches") or [])[:20]
    updates = t0.get("delta_updates")
    if updates:
        full = [u["update_s"] for u in updates if u["mode"] == "full"]
        delta = [u["update_s"] for u in updates if u["mode"] == "delta"]
        d: dict[str, Any] = {
            "density": cfg.delta_density,
            "full_s": _spread(full),
            "delta_s": _spread(delta),
            "wire_fraction": _spread(
                [u["wire_bytes"] / u["full_bytes"] for u in updates if u["mode"] == "delta"]
            ),
            "encode_s": _spread([u["encode_s"] for u in updates if u["mode"] == "delta"]),
            "engine_apply_s": _spread(res.get("engine0", {}).get("apply_s", [])),
            "engine_wait_and_apply_s": _spread(res.get("engine0", {}).get("wait_apply_s", [])),
            "snapshot_bytes": t0.get("snapshot_bytes"),
            "snapshot_device": t0.get("snapshot_device"),
            "patch_staging_bytes": t0.get("patch_staging_bytes"),
            "patch_region_bytes": res.get("engine0", {}).get("patch_region_bytes"),
            "modes": [f"{u['mode']}: {u['reason']}" for u in updates],
        }
        if full and delta:
            d["delta_over_full"] = _median(delta) / _median(full)
        s["delta"] = d
    res["summary"] = s


def plot_timeline(records: list[dict[str, Any]], path: str, title: str = "") -> None:
    """PNG: one row per task, prepare and write stages as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = sorted(records, key=lambda r: r["task_id"])
    fig, ax = plt.subplots(figsize=(10, 0.12 * len(recs) + 1.5))
    for i, r in enumerate(recs):
        ax.broken_barh(
            [(r["prepare_start"] * 1e3, max(1e-3, (r["prepare_end"] - r["prepare_start"]) * 1e3))],
            (i, 0.8),
            color="tab:orange",
        )
        ax.broken_barh(
            [(r["write_start"] * 1e3, max(1e-3, (r["write_end"] - r["write_start"]) * 1e3))],
            (i, 0.8),
            color="tab:blue",
        )
    ax.set_xlabel("ms since update start")
    ax.set_ylabel("task")
    ax.set_title(f"{title}: prepare (orange) and write (blue) per task")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def preset_names() -> list[str]:
    """The names `--preset` accepts."""
    from weight_transfer.planner.presets.models import MODEL_SHAPES

    return sorted(MODEL_SHAPES) + ["deepseek-v3-slice"]


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of `bench update`."""
    p = p or argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--preset",
        default="llama-3.1-8b",
        choices=preset_names(),
        metavar="PRESET",
        help=f"model shapes, one of: {', '.join(preset_names())}",
    )
    p.add_argument("--backend", default="loopback", choices=sorted(BACKENDS), help="transport")
    p.add_argument("--fp8", action="store_true", help="engine holds FP8 block-quantized weights")
    p.add_argument(
        "--offload", action="store_true", help="trainer parameters in pinned host memory"
    )
    p.add_argument(
        "--layout",
        default="split",
        choices=list(LAYOUTS),
        help="split: trainer on GPU0, engine on GPU1; colocated: both processes on both "
        "GPUs; one-gpu: trainer and engine processes share GPU0",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed updates")
    p.add_argument("--warmups", type=int, default=1, help="untimed updates first")
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the preset (0: all)")
    p.add_argument(
        "--no-sync",
        action="store_true",
        help="update right after a long kernel changed the weights",
    )
    p.add_argument("--memory-budget-bytes", type=int, default=4 << 30, help="sender budget")
    p.add_argument(
        "--delta-density",
        type=float,
        default=0.0,
        help="delta mode: fraction of elements changed per update (docs/delta.md)",
    )
    p.add_argument("--delta-anchor", type=int, default=2, help="delta mode: a full update every N")
    p.add_argument(
        "--delta-full-when-slower",
        action="store_true",
        help="delta mode: full updates while the last delta was slower than a full one",
    )
    p.add_argument(
        "--delta-snapshot", default="device", choices=["device", "host"], help="snapshot memory"
    )
    p.add_argument(
        "--delta-kernels", default="auto", choices=list(DELTA_KERNELS), help="GPU delta kernels"
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the rank-0 NCCL baseline")
    p.add_argument("--timeout-s", type=float, default=500.0, help="limit for the whole run")
    p.add_argument("--json", default="bench_update.json", help="where the results go")
    p.add_argument("--trace", default="", help="Perfetto trace of the last timed update")
    p.add_argument("--plot", default="", help="PNG timeline of that update (needs matplotlib)")
    p.add_argument(
        "--profile",
        default="",
        help="cProfile text of trainer 0's timed updates (PATH.STEP; PATH.engine.STEP: engine 0)",
    )
    p.add_argument(
        "--no-table-quant",
        action="store_true",
        help="FP8 graph groups: one quantize kernel per call instead of one table launch",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option (repeatable)",
    )
    return p


def gpus_needed(cfg: BenchUpdateConfig) -> int:
    """How many CUDA devices the layout uses."""
    gpus = {_trainer_gpu(cfg, r) for r in range(_n_trainers(cfg))}
    gpus |= {_engine_gpu(cfg, r) for r in range(_n_engines(cfg))}
    return max(gpus) + 1


def check_runnable(cfg: BenchUpdateConfig) -> str | None:
    """Why this machine cannot run `cfg` (one line), or None. Checked before any process starts."""
    need = gpus_needed(cfg)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        return (
            f"bench update --layout {cfg.layout} needs {need} CUDA GPU(s); this host has {have} "
            f"(torch {torch.__version__})"
        )
    if cfg.plot_path and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'matplotlib>=3.7'"
    return None


def main(ns: argparse.Namespace) -> int:
    """Entry point for `weight-transfer bench update` (namespace from `build_parser`)."""
    try:
        options = []
        for o in ns.option:
            key, eq, value = o.partition("=")
            if not eq or not key:
                raise ValueError(f"--option {o!r}: expected KEY=VALUE")
            options.append((key, value))
        cfg = BenchUpdateConfig(
            preset=ns.preset,
            backend=ns.backend,
            fp8=ns.fp8,
            offload=ns.offload,
            layout=ns.layout,
            repeats=ns.repeats,
            warmups=ns.warmups,
            layers=ns.layers,
            no_sync=ns.no_sync,
            memory_budget_bytes=ns.memory_budget_bytes,
            baseline=not ns.no_baseline,
            timeout_s=ns.timeout_s,
            json_path=ns.json,
            trace_path=ns.trace,
            plot_path=ns.plot,
            profile_path=ns.profile,
            transport_options=tuple(options),
            delta_density=ns.delta_density,
            delta_anchor=ns.delta_anchor,
            delta_full_when_slower=ns.delta_full_when_slower,
            delta_snapshot=ns.delta_snapshot,
            delta_kernels=ns.delta_kernels,
            table_quantize=not ns.no_table_quant,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = check_runnable(cfg)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(
        f"bench update: {cfg.preset} {'FP8' if cfg.fp8 else 'BF16'} backend={cfg.backend} "
        f"layout={cfg.layout} offload={cfg.offload}",
        file=sys.stderr,
        flush=True,
    )
    res = run(cfg)
    print(json.dumps(res["summary"], indent=1))
    for e in res["errors"]:
        print(e, file=sys.stderr)
    return 0 if res["summary"].get("verified") else 1


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
