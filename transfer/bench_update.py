"""`weight-transfer bench update`: whole updates on GPUs beside the ceiling and today's baseline.

Layouts (2 GPUs):
- "split": one trainer rank (FSDP2, world 1) on GPU0 writes into one engine rank (tp=1) on GPU1,
  in another process.
- "colocated": FSDP2 over both GPUs (2 trainer processes) into an engine with tp=2 over both GPUs
  (2 more processes); every trainer rank sends.

Measured in one run, on the same weights:
- ours: `WeightSender.update` wall time on trainer rank 0 (includes the control-plane commit);
- ceiling: an in-process peer copy GPU0->GPU1 of the same number of bytes (split layout);
- baseline: what RL frameworks do today: trainer rank 0 packs HF tensors into 1 GiB buckets and
  NCCL-broadcasts them to a temporary buffer on each engine rank, which then copies (fuses,
  quantizes with the same GPU kernel) into its own parameters;
After the timed updates the weights are perturbed once more, updated, and every engine tensor's
fingerprint (`transfer.verify`) is compared with the reference recipes applied to the trainer's
full weights. Results go to JSON; a Perfetto trace and a PNG timeline show one update's stages.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


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
    """"split" (GPU0 -> GPU1) or "colocated" (FSDP2 and tp=2 over both GPUs)."""
    repeats: int = 5
    """Timed updates (after one warm-up)."""
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
    transport_options: tuple[tuple[str, str], ...] = ()
    """Backend options."""

    def __post_init__(self) -> None:
        if self.layout not in ("split", "colocated"):
            raise ValueError("layout must be 'split' or 'colocated'")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a preset gives the benchmark: trainer tensors and each engine rank's layout."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    """Trainer tensors that are not bfloat16."""
    preset: str

    def recipes(self, rank: int, tp: int, fp8: bool) -> Any:
        """Recipes of engine rank `rank` of `tp`."""
        if self.preset == "deepseek-v3-slice":
            from weight_transfer.planner.presets.deepseek import mla_recipes

            return mla_recipes(_mla_slice(), tp_rank=rank, tp_size=tp, fp8=fp8)
        from weight_transfer.planner.presets.models import get_model_shape
        from weight_transfer.planner.presets.vllm import vllm_recipes

        return vllm_recipes(get_model_shape(self.preset), rank, tp, fp8=fp8)

    def specs(self, rank: int, tp: int, fp8: bool) -> Any:
        """Engine tensors (name, shape, dtype) of that rank."""
        from weight_transfer.planner.recipes import engine_tensor_specs

        extra: dict[str, str] = {}
        if self.preset == "deepseek-v3-slice":
            from weight_transfer.planner.presets.deepseek import mla_engine_dtypes

            extra = mla_engine_dtypes(_mla_slice())
        return engine_tensor_specs(self.recipes(rank, tp, fp8), param_dtype="bfloat16", dtypes=extra)


def _mla_slice() -> Any:
    from weight_transfer.planner.presets.deepseek import MLA_SHAPES

    # Two real DeepSeek-V3 layers: a dense one and a MoE one (256 experts, shared expert).
    return dataclasses.replace(MLA_SHAPES["deepseek-v3"], num_layers=2, first_k_dense=1)


def model_spec(preset: str) -> ModelSpec:
    """Shapes of a model preset (`planner.presets.models`, or "deepseek-v3-slice")."""
    if preset == "deepseek-v3-slice":
        from weight_transfer.planner.presets.deepseek import mla_parameter_shapes, mla_source_dtypes

        shape = _mla_slice()
        return ModelSpec(mla_parameter_shapes(shape), mla_source_dtypes(shape), preset)
    from weight_transfer.planner.presets.models import get_model_shape, hf_parameter_shapes

    return ModelSpec(hf_parameter_shapes(get_model_shape(preset)), {}, preset)


def param_module(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
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
        m.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False))
    return root


def _layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    return list(layers.children()) if layers is not None else []


def _n_trainers(cfg: BenchUpdateConfig) -> int:
    return 1 if cfg.layout == "split" else 2


def _n_engines(cfg: BenchUpdateConfig) -> int:
    return 1 if cfg.layout == "split" else 2


def _trainer_gpu(cfg: BenchUpdateConfig, rank: int) -> int:
    return rank


def _engine_gpu(cfg: BenchUpdateConfig, rank: int) -> int:
    return 1 if cfg.layout == "split" else rank


def _perturb(model: nn.Module, seed: int) -> None:
    from weight_transfer.transfer.manifest import local_part

    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = local_part(p)
            if local.numel():
                local.add_(float(torch.rand((), generator=g)) * 0.01)


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


def trainer_main(rank: int, cfg: BenchUpdateConfig, ports: dict[str, int], token: str, out: Any) -> None:
    """Trainer rank: FSDP2 over the trainer GPUs, our updates, then the baseline broadcasts."""
    os.environ.update(NCCL_ENV)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from weight_transfer.backends.base import TransportConfig
    from weight_transfer.transfer.config import ControllerConfig, ControlPlaneConfig, SenderConfig
    from weight_transfer.transfer.controller import Controller
    from weight_transfer.transfer.manifest import torch_dtype
    from weight_transfer.transfer.protocol import Digests
    from weight_transfer.transfer.sender import WeightSender, full_tensor
    from weight_transfer.transfer.verify import expected_fingerprints

    gpu = _trainer_gpu(cfg, rank)
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    world = _n_trainers(cfg)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["dist"]))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    res: dict[str, Any] = {"rank": rank}
    try:
        spec = model_spec(cfg.preset)
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
        controller = None
        if rank == 0:
            from weight_transfer.planner.plan import PlannerConfig

            controller = Controller(
                ControllerConfig(
                    num_trainer_ranks=world, num_engines=_n_engines(cfg),
                    planner=PlannerConfig(memory_budget_bytes=cfg.memory_budget_bytes),
                ),
                control,
            )
        torch.cuda.reset_peak_memory_stats(dev)
        sender = WeightSender(
            model, rank=rank, world_size=world,
            transport=TransportConfig(name=cfg.backend, device_index=gpu, options=cfg.transport_options),
            control=control, controller=controller, device=dev,
            config=SenderConfig(memory_budget_bytes=cfg.memory_budget_bytes, update_timeout_s=cfg.timeout_s),
        )
        if controller is not None:
            assert controller.schedule is not None
            res["bytes_per_rank"] = list(controller.schedule.bytes_per_rank)
            res["bytes_per_engine"] = list(controller.schedule.bytes_per_engine)
            res["num_tasks"] = [len(r.tasks) for r in controller.schedule.ranks]
        times = []
        step = 0
        for i in range(cfg.repeats + 1):
            step += 1
            dist.barrier()
            torch.cuda.synchronize()
            stats = sender.update(step)
            if i > 0:
                times.append(stats.seconds)
            res.setdefault("wall_s", []).append(stats.seconds)
            res["update_bytes"] = stats.nbytes
        res["ours_s"] = times
        res["peak_extra_gpu_bytes"] = torch.cuda.max_memory_allocated(dev) - base_mem
        res["peak_staging_bytes"] = stats.peak_staging_bytes
        res["peak_scratch_bytes"] = stats.peak_scratch_bytes
        if cfg.trace_path and rank == 0:
            sender.write_trace(cfg.trace_path)
            res["records"] = [dataclasses.asdict(r) for r in stats.records]
        # Verification: change the weights, update, compare every engine tensor.
        _perturb(model, 777)
        step += 1
        sender.update(step)
        with torch.no_grad():
            full = {n: full_tensor(p, dev) for n, p in model.named_parameters()}
        if rank == 0:
            mismatches = []
            tp = _n_engines(cfg)
            for e in range(tp):
                recipes = spec.recipes(e, tp, cfg.fp8)
                specs = spec.specs(e, tp, cfg.fp8)
                want = expected_fingerprints(recipes, {s.name: (s.shape, torch_dtype(s.dtype)) for s in specs}, full)
                got = dict(sender._control.get(f"digest/{step}/engine{e}", Digests, cfg.timeout_s).digests)
                mismatches += [f"engine{e}:{n}" for n, v in want.items() if got.get(n) != str(v)]
                res.setdefault("verified_tensors", 0)
                res["verified_tensors"] += len(want)
            res["mismatches"] = mismatches
            res["verify_step"] = step
        del full
        torch.cuda.empty_cache()
        dist.barrier()
        # Ceiling: in-process peer copy of the same bytes (split layout: GPU0 -> GPU1).
        if rank == 0 and cfg.layout == "split":
            nb = res["update_bytes"]
            chunk = min(nb, 4 << 30)
            a = torch.empty(chunk, dtype=torch.uint8, device=dev).random_()
            b = torch.empty(chunk, dtype=torch.uint8, device="cuda:1")
            ts = []
            for _ in range(4):
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                t0 = time.perf_counter()
                left = nb
                while left > 0:
                    n = min(chunk, left)
                    b[:n].copy_(a[:n], non_blocking=True)
                    left -= n
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                ts.append(time.perf_counter() - t0)
            res["ceiling_s"] = ts[1:]
            # Pinned host -> device rate of the same bytes (the offload ceiling).
            h = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
            ts = []
            for _ in range(3):
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
    except BaseException:
        import traceback

        out.put(("error", f"trainer{rank}", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _baseline_trainer(cfg: BenchUpdateConfig, rank: int, model: nn.Module, shapes: dict[str, tuple[int, ...]], ports: dict[str, int], dev: torch.device) -> dict[str, Any]:
    """Rank-0 funnel: gather on rank 0, broadcast 1 GiB buckets to every engine rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", ports["baseline"], is_master=(rank == 0), timeout=datetime.timedelta(seconds=cfg.timeout_s), wait_for_workers=False)  # type: ignore[attr-defined]  # not re-exported in torch's stubs
    size = 1 + _n_engines(cfg)
    from weight_transfer.transfer.sender import full_tensor

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
                bucket[off:off + k].copy_(t[pos:pos + k])
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


def engine_main(rank: int, cfg: BenchUpdateConfig, ports: dict[str, int], token: str, out: Any) -> None:
    """Engine rank: vLLM-layout tensors on its GPU, registered once; then the baseline."""
    os.environ.update(NCCL_ENV)
    from weight_transfer.backends.base import TransportConfig
    from weight_transfer.transfer.config import ControlPlaneConfig
    from weight_transfer.transfer.manifest import torch_dtype
    from weight_transfer.transfer.protocol import Digests
    from weight_transfer.transfer.receiver import WeightReceiver
    from weight_transfer.transfer.verify import fingerprint

    gpu = _engine_gpu(cfg, rank)
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    try:
        spec = model_spec(cfg.preset)
        tp = _n_engines(cfg)
        recipes = spec.recipes(rank, tp, cfg.fp8)
        specs = spec.specs(rank, tp, cfg.fp8)
        g = torch.Generator(device=dev).manual_seed(5 + rank)
        tensors = {}
        for s in specs:
            t = torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=dev)
            t.view(torch.uint8).random_(generator=g) if t.element_size() == 1 else t.normal_(generator=g)
            tensors[s.name] = t
        torch.cuda.synchronize()
        control = ControlPlaneConfig(port=ports["control"], token=token, timeout_s=cfg.timeout_s)
        rx = WeightReceiver(tensors, recipes, engine=f"engine{rank}",
                            transport=TransportConfig(name=cfg.backend, device_index=gpu, options=cfg.transport_options),
                            control=control)
        verify_step = cfg.repeats + 2
        rx.wait_for_version(verify_step, cfg.timeout_s)
        torch.cuda.synchronize()
        fp = {n: str(fingerprint(t)) for n, t in tensors.items()}
        rx._control.put(f"digest/{verify_step}/engine{rank}", Digests(engine=f"engine{rank}", step=verify_step, version=rx.version, digests=tuple(sorted(fp.items()))))
        res: dict[str, Any] = {"rank": rank, "engine_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        if cfg.baseline and cfg.layout == "split":
            res.update(_baseline_engine(cfg, rank, spec, recipes, specs, tensors, ports, dev))
        rx.close()
        out.put(("engine", rank, res))
    except BaseException:
        import traceback

        out.put(("error", f"engine{rank}", traceback.format_exc()))
        raise


def _baseline_engine(cfg: BenchUpdateConfig, rank: int, spec: ModelSpec, recipes: Any, specs: Any, tensors: dict[str, torch.Tensor], ports: dict[str, int], dev: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    from weight_transfer.transfer.verify import build_engine_tensor

    store = dist.TCPStore("127.0.0.1", ports["baseline"], is_master=False, timeout=datetime.timedelta(seconds=cfg.timeout_s), wait_for_workers=False)  # type: ignore[attr-defined]  # not re-exported in torch's stubs
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
    from weight_transfer.transfer.manifest import torch_dtype

    for _ in range(cfg.repeats + 1):
        received: dict[str, torch.Tensor] = {}
        pending: dict[str, torch.Tensor] = {}
        order = [(n, int(torch.Size(shapes[n]).numel()) * src_dtype[n].itemsize) for n in names]
        cursor = [0, 0]  # tensor index, byte offset within it
        total = sum(nb for _, nb in order)
        done_bytes = 0
        loaded: set[str] = set()

        def load_ready(received: dict[str, torch.Tensor] = received, loaded: set[str] = loaded, pending: dict[str, torch.Tensor] = pending) -> None:
            # Like an engine's load_weights: build each parameter once all its sources arrived.
            for n in list(received):
                for r in need.get(n, []):
                    if r.dest in loaded or any(p.source not in received for p in r.parts):
                        continue
                    s = spec_of[r.dest]
                    built = build_engine_tensor(r, s.shape, torch_dtype(s.dtype), received) if r.quant is None else None
                    if r.quant is not None:
                        from weight_transfer.transfer.kernels.fp8_triton import quantize_fp8

                        # Assemble in float32 and quantize, one leading slice (expert) at a time.
                        lead = s.shape[0] if len(s.shape) > 2 else 1
                        for e in range(lead):
                            sub = [p for p in r.parts if len(s.shape) == 2 or p.dest_box[0][0] == e]
                            hp = torch.empty(s.shape[-2:], dtype=torch.float32, device=dev)
                            for p in sub:
                                box = p.dest_box[-2:]
                                hp[tuple(slice(a, b) for a, b in box)] = received[p.source][tuple(slice(a, b) for a, b in p.source_box)].reshape(tuple(b - a for a, b in box))
                            q = tensors[r.dest] if len(s.shape) == 2 else tensors[r.dest][e]
                            sc = tensors[r.quant.scale_dest] if len(s.shape) == 2 else tensors[r.quant.scale_dest][e]
                            quantize_fp8(hp, r.quant.block, out_q=q, out_scale=sc)
                    else:
                        assert built is not None
                        tensors[r.dest].copy_(built[r.dest])
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
                dst[cursor[1]:cursor[1] + k].copy_(bucket[pos:pos + k])
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
    from weight_transfer.transfer.demo import free_port

    from weight_transfer.transfer.child_reports import ReportInbox

    ctx = mp.get_context("spawn")
    inbox = ReportInbox(ctx)  # one pipe per child: a dead child cannot block the others
    ports = {"dist": free_port(), "control": free_port(), "baseline": free_port()}
    token = secrets.token_hex(16)
    procs = {}
    for r in range(_n_trainers(cfg)):
        procs[f"trainer{r}"] = ctx.Process(target=trainer_main, args=(r, cfg, ports, token, inbox.reporter()))
    for e in range(_n_engines(cfg)):
        procs[f"engine{e}"] = ctx.Process(target=engine_main, args=(e, cfg, ports, token, inbox.reporter()))
    for p in procs.values():
        p.start()
    inbox.started()
    results: dict[str, Any] = {"config": dataclasses.asdict(cfg), "errors": []}
    deadline = time.monotonic() + cfg.timeout_s + 60
    expected = len(procs)
    got = 0
    while got < expected and time.monotonic() < deadline:
        msg = inbox.get(timeout=1.0)
        if msg is None:
            if any(p.exitcode not in (None, 0) for p in procs.values()):
                break
            continue
        if msg[0] == "error":
            results["errors"].append(f"{msg[1]}: {msg[2]}")
            got += 1
        else:
            results[f"{msg[0]}{msg[1]}"] = msg[2]
            got += 1
    for name, p in procs.items():
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            results["errors"].append(f"{name} killed after the deadline")
        results.setdefault("exit_codes", {})[name] = p.exitcode
    inbox.close()
    _summarize(results, cfg)
    with open(cfg.json_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    if cfg.plot_path and "trainer0" in results and results["trainer0"].get("records"):
        plot_timeline(results["trainer0"]["records"], cfg.plot_path, title=f"{cfg.preset} {'FP8' if cfg.fp8 else 'BF16'} {cfg.backend}")
    return results


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summarize(res: dict[str, Any], cfg: BenchUpdateConfig) -> None:
    t0 = res.get("trainer0", {})
    ours = _median(t0.get("ours_s", []))
    nbytes = t0.get("update_bytes", 0)
    s = {
        "ours_median_s": ours,
        "ours_spread_s": [min(t0.get("ours_s", [0])), max(t0.get("ours_s", [0]))],
        "bytes_written": nbytes,
        "ours_gbps": nbytes / ours / 1e9 if ours == ours and ours > 0 else None,
    }
    if "ceiling_s" in t0:
        c = _median(t0["ceiling_s"])
        s["ceiling_median_s"] = c
        s["ceiling_gbps"] = nbytes / c / 1e9
        s["ratio_to_ceiling"] = ours / c
    if "h2d_s" in t0:
        h = _median(t0["h2d_s"])
        s["h2d_median_s"] = h
        s["ratio_to_h2d"] = ours / h
    if "baseline_s" in t0:
        b = _median(t0["baseline_s"])
        s["baseline_median_s"] = b
        s["speedup_vs_baseline"] = b / ours
    s["peak_extra_gpu_bytes"] = t0.get("peak_extra_gpu_bytes")
    s["memory_budget_bytes"] = cfg.memory_budget_bytes
    s["verified"] = (not t0.get("mismatches")) and t0.get("verified_tensors", 0) > 0 and not res["errors"]
    s["mismatches"] = (t0.get("mismatches") or [])[:20]
    res["summary"] = s


def plot_timeline(records: list[dict[str, Any]], path: str, title: str = "") -> None:
    """PNG: one row per task, prepare and write stages as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = sorted(records, key=lambda r: r["task_id"])
    fig, ax = plt.subplots(figsize=(10, 0.12 * len(recs) + 1.5))
    for i, r in enumerate(recs):
        ax.broken_barh([(r["prepare_start"] * 1e3, max(1e-3, (r["prepare_end"] - r["prepare_start"]) * 1e3))], (i, 0.8), color="tab:orange")
        ax.broken_barh([(r["write_start"] * 1e3, max(1e-3, (r["write_end"] - r["write_start"]) * 1e3))], (i, 0.8), color="tab:blue")
    ax.set_xlabel("ms since update start")
    ax.set_ylabel("task")
    ax.set_title(f"{title}: prepare (orange) and write (blue) per task")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of `bench update`."""
    p = p or argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--backend", default="loopback")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--offload", action="store_true")
    p.add_argument("--layout", default="split", choices=["split", "colocated"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory-budget-bytes", type=int, default=4 << 30)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--timeout-s", type=float, default=500.0)
    p.add_argument("--json", default="bench_update.json")
    p.add_argument("--trace", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--option", action="append", default=[], help="backend option KEY=VALUE")
    return p


def main(ns: argparse.Namespace) -> int:
    """Entry point for `weight-transfer bench update` (namespace from `build_parser`)."""
    cfg = BenchUpdateConfig(
        preset=ns.preset, backend=ns.backend, fp8=ns.fp8, offload=ns.offload, layout=ns.layout,
        repeats=ns.repeats, memory_budget_bytes=ns.memory_budget_bytes, baseline=not ns.no_baseline,
        timeout_s=ns.timeout_s, json_path=ns.json, trace_path=ns.trace, plot_path=ns.plot,
        transport_options=tuple(tuple(o.split("=", 1)) for o in ns.option),
    )
    print(f"bench update: {cfg.preset} {'FP8' if cfg.fp8 else 'BF16'} backend={cfg.backend} layout={cfg.layout} offload={cfg.offload}", file=sys.stderr, flush=True)
    res = run(cfg)
    print(json.dumps(res["summary"], indent=1))
    for e in res["errors"]:
        print(e, file=sys.stderr)
    return 0 if res["summary"].get("verified") else 1


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
