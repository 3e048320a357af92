"""Cluster presets: real trainer and engine layouts described by manifests, without any weights.

A `ClusterPreset` names a model, a trainer layout, an engine layout and the hardware (GPUs per
node, NIC and NVLink rates in `planner.simulate.Rates`). `cluster_manifests` turns it into the
source and destination manifests the planner takes, exactly as live trainer and engine processes
would publish them, so `planner.plan.plan` and `planner.simulate.simulate` run on a laptop.

Trainer layout (FSDP2 with expert parallelism, `TrainerLayout`):

* Every non-expert parameter is sharded on dim 0 over a shard group of `dense_shard_size`
  consecutive ranks, the way ``torch.chunk`` splits (chunks of ``ceil(n / k)`` rows; trailing
  shards may be short or empty). With ``dense_shard_size < num_gpus`` the groups are replicas
  (HSDP): every group holds the whole parameter on its own, disjoint mesh.
* Routed experts are split over ``num_gpus / expert_shard_size`` disjoint expert meshes of
  `expert_shard_size` consecutive ranks (expert mesh m holds a contiguous block of experts of
  every layer, like torchtitan's expert parallelism); each expert tensor is FSDP-sharded on
  dim 0 inside its mesh. Meshes that share no rank run their collectives in parallel (one mesh
  group), which is what makes the layout fast.
* `offload`: shards live in host memory (FSDP2 CPU offload); the simulator charges a
  host-to-device copy before their preparation.

Engine layout (`EngineLayout`): `num_replicas` identical replicas of ``max(tp, ep)`` GPUs.
Attention and dense layers are tensor parallel over `tp` ranks (``ep / tp`` data-parallel
attention groups when ``ep > tp``); routed experts are split whole over `ep` ranks (or tensor
parallel when ``ep == 1``). BF16 or FP8 block-quantized weights. Each engine rank exposes one
region holding its tensors back to back and an 8-byte version region; descriptors are dummies.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from weight_transfer.errors import ConfigurationError
from weight_transfer.planner.fp8 import scale_shape
from weight_transfer.planner.presets.deepseek import (
    MLA_SHAPES,
    MlaShape,
    mla_engine_dtypes,
    mla_parameter_shapes,
    mla_recipes,
    mla_source_dtypes,
)
from weight_transfer.planner.presets.models import MODEL_SHAPES, ModelShape, hf_parameter_shapes
from weight_transfer.planner.presets.vllm import vllm_recipes
from weight_transfer.planner.reference import FP8_DTYPE
from weight_transfer.planner.simulate import Rates
from weight_transfer.planner.types import (
    Box,
    DestManifest,
    DestRegion,
    DestTensor,
    Recipe,
    SourceManifest,
    SourceTensor,
    dtype_size,
    numel,
)

_ALIGN = 256
_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.")

LARGE_SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen3-235B-A22B config.json.
    "qwen3-235b-a22b": ModelShape(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        moe_intermediate_size=1536,
        qk_norm=True,
    ),
    # meta-llama/Llama-3.1-405B config.json.
    "llama-3.1-405b": ModelShape(
        vocab_size=128256,
        hidden_size=16384,
        intermediate_size=53248,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
    ),
}
"""Large Llama/Qwen-style shapes used by the cluster presets."""

SMALL_MLA: dict[str, MlaShape] = {
    # Kimi-K2's structure (MLA, first dense layer, shared + routed experts) at toy sizes.
    "kimi-k2-mini": MlaShape(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
        num_heads=8,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=16,
        moe_intermediate_size=128,
        num_shared_experts=1,
        first_k_dense=1,
    ),
}
"""Small MLA shapes with the structure of the large ones (tests, quick runs)."""

AnyShape = ModelShape | MlaShape

EMU_SHAPES: dict[str, AnyShape] = {
    # Llama-style, 13.6 M parameters (27 MB in BF16): tens of MB at 10-50 MB/s per link.
    "emu-dense": ModelShape(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=3,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    ),
    # Kimi-K2's structure (MLA, a first dense layer, shared + 16 routed experts) at tens of MB.
    "emu-moe": MlaShape(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=3,
        num_heads=8,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=16,
        moe_intermediate_size=256,
        num_shared_experts=1,
        first_k_dense=1,
    ),
}
"""Shapes of tens of MB for the emulated cluster (`weight-transfer emulate`)."""


def get_shape(name: str) -> AnyShape:
    """Any named model shape (MLA, large, or `planner.presets.models.MODEL_SHAPES`).

    Raises:
        ConfigurationError: unknown name (the message lists the known ones).
    """
    for table in (MLA_SHAPES, SMALL_MLA, LARGE_SHAPES, MODEL_SHAPES, EMU_SHAPES):
        if name in table:
            return table[name]
    known = sorted({*MLA_SHAPES, *SMALL_MLA, *LARGE_SHAPES, *MODEL_SHAPES, *EMU_SHAPES})
    raise ConfigurationError(f"unknown model {name!r}; known: {', '.join(known)}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerLayout:
    """FSDP2 trainer with expert parallelism as disjoint meshes (module docstring)."""

    num_gpus: int
    """Trainer ranks (one GPU each)."""
    dense_shard_size: int
    """Ranks that shard one copy of a non-expert parameter (num_gpus for plain FSDP)."""
    expert_shard_size: int
    """Ranks of one expert mesh (num_gpus / this = number of expert-parallel meshes)."""
    dtype: str = "bfloat16"
    """Trainer parameter dtype."""
    offload: bool = False
    """Parameters live in host memory (FSDP2 CPU offload)."""

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError("TrainerLayout.num_gpus must be positive")
        for name in ("dense_shard_size", "expert_shard_size"):
            k = getattr(self, name)
            if k < 1 or self.num_gpus % k:
                raise ValueError(f"TrainerLayout.{name}={k} must divide num_gpus={self.num_gpus}")
        dtype_size(self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineLayout:
    """Inference replicas: tensor-parallel attention, expert-parallel experts."""

    num_replicas: int
    """Identical engine replicas, each receiving a full copy of the weights."""
    tp: int
    """Tensor-parallel size of attention and dense layers."""
    ep: int = 1
    """Expert-parallel size (GPUs per replica when > 1; a multiple of tp)."""
    fp8: bool = True
    """FP8 block-quantized linear weights (else BF16 copies)."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.tp < 1 or self.ep < 1:
            raise ValueError("EngineLayout: num_replicas, tp and ep must be positive")
        if self.ep > 1 and self.ep % self.tp:
            raise ValueError(f"EngineLayout: ep={self.ep} must be a multiple of tp={self.tp}")

    @property
    def gpus_per_replica(self) -> int:
        """Engine ranks in one replica."""
        return max(self.tp, self.ep)

    @property
    def num_gpus(self) -> int:
        """Engine ranks in all replicas."""
        return self.num_replicas * self.gpus_per_replica


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClusterPreset:
    """A model on a trainer cluster and an engine cluster, with the hardware's rates."""

    name: str
    """Preset name."""
    model: str
    """Model shape name (`get_shape`)."""
    trainer: TrainerLayout
    """Trainer layout."""
    engine: EngineLayout
    """Engine layout."""
    gpus_per_node: int = 8
    """GPUs per host, trainer and engine alike (decides what NVLink connects)."""
    rates: Rates = dataclasses.field(default_factory=Rates)
    """Link and stage rates used by the simulator."""
    shared_hosts: bool = False
    """Trainer and engine GPUs are numbered in the same hosts (one machine for both: writes go
    over NVLink), rather than trainer and engine clusters of their own."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError("ClusterPreset.gpus_per_node must be positive")
        get_shape(self.model)

    def describe(self) -> str:
        """One line: model, trainer and engine layouts."""
        t, e = self.trainer, self.engine
        return (
            f"{self.model}: {t.num_gpus} trainer GPUs ({t.dtype}, FSDP shard {t.dense_shard_size}"
            f", expert meshes of {t.expert_shard_size}{', offload' if t.offload else ''}) -> "
            f"{e.num_gpus} engine GPUs ({e.num_replicas} x {e.gpus_per_replica}, tp {e.tp}, "
            f"ep {e.ep}, {'FP8' if e.fp8 else 'BF16'}), {self.gpus_per_node} GPUs/node, "
            f"{self.rates.nics_per_gpu} x {self.rates.nic_gb_per_s:g} GB/s NIC per GPU"
        )


H200X2_RATES = Rates(
    nic_gb_per_s=50.0,
    nvlink_gb_per_s=395.0,
    h2d_gb_per_s=55.0,
    prepare_gb_per_s=1150.0,
    quantize_gb_per_s=767.0,
    barrier_s=0.0,
    collective_latency_s=0.0,
    write_latency_s=0.0,
    write_overhead_s=9.4e-6,
    task_overhead_s=72e-6,
)
"""Rates of the 2x H200 machine of the GPU benchmarks (2026-11-30), from microbenchmarks only
(`benchmarks/results/simulator_vs_h200_202611.md` explains each; the update times are not used)."""


def _h200x2(name: str, model: str, *, fp8: bool = False, colocated: bool = False) -> ClusterPreset:
    """`benchmarks/bench_update.py` on 2 H200s: "split" is one FSDP2 trainer rank on GPU0 writing
    into one engine rank (tp=1) on GPU1; "colocated" is FSDP2 over both GPUs writing into an
    engine with tp=2 over both GPUs."""
    n = 2 if colocated else 1
    return ClusterPreset(
        name=name,
        model=model,
        trainer=TrainerLayout(num_gpus=n, dense_shard_size=n, expert_shard_size=n),
        engine=EngineLayout(num_replicas=1, tp=n, fp8=fp8),
        gpus_per_node=2,
        rates=H200X2_RATES,
        shared_hosts=True,
    )


EMU_RATES = Rates(
    nic_gb_per_s=0.0192,
    nvlink_gb_per_s=0.0192,
    barrier_s=0.0,
    collective_latency_s=0.0,
    write_latency_s=0.0,
)
"""Rates of one emulated host (`benchmarks/netns.py`): a 20 MB/s token bucket per link carries
about 19.2 MB/s of TCP payload (1448 of every 1514 frame bytes). `weight-transfer emulate`
measures the ceiling and the CPU's copy and quantize rates in the same run and uses those."""


def _emu(
    name: str, model: str, trainer: int, dense: int, expert: int, engine: EngineLayout
) -> ClusterPreset:
    """An emulated cluster: every trainer and engine rank is a host of its own (one NIC each)."""
    return ClusterPreset(
        name=name,
        model=model,
        trainer=TrainerLayout(num_gpus=trainer, dense_shard_size=dense, expert_shard_size=expert),
        engine=engine,
        gpus_per_node=1,
        rates=EMU_RATES,
    )


PRESETS: dict[str, ClusterPreset] = {
    # Perplexity's setting: 256 BF16 trainer GPUs -> 128 FP8 engine GPUs, 400 Gb/s per GPU.
    # Engines: 4 replicas of 32 GPUs (DP-attention 4 x tp 8, experts EP 32).
    "kimi-k2": ClusterPreset(
        name="kimi-k2",
        model="kimi-k2",
        trainer=TrainerLayout(num_gpus=256, dense_shard_size=8, expert_shard_size=8),
        engine=EngineLayout(num_replicas=4, tp=8, ep=32),
    ),
    # The same 128 engine GPUs as 8 replicas of 16 (tp 16, EP 16): twice the bytes to receive.
    "kimi-k2-ep16": ClusterPreset(
        name="kimi-k2-ep16",
        model="kimi-k2",
        trainer=TrainerLayout(num_gpus=256, dense_shard_size=8, expert_shard_size=8),
        engine=EngineLayout(num_replicas=8, tp=16, ep=16),
    ),
    "deepseek-v3": ClusterPreset(
        name="deepseek-v3",
        model="deepseek-v3",
        trainer=TrainerLayout(num_gpus=128, dense_shard_size=8, expert_shard_size=8),
        engine=EngineLayout(num_replicas=4, tp=8, ep=16),
    ),
    # Perplexity's earlier post: Qwen3-235B, 128 -> 32 GPUs.
    "qwen3-235b-a22b": ClusterPreset(
        name="qwen3-235b-a22b",
        model="qwen3-235b-a22b",
        trainer=TrainerLayout(num_gpus=128, dense_shard_size=8, expert_shard_size=8),
        engine=EngineLayout(num_replicas=4, tp=8),
    ),
    "llama-3.1-405b": ClusterPreset(
        name="llama-3.1-405b",
        model="llama-3.1-405b",
        trainer=TrainerLayout(num_gpus=128, dense_shard_size=8, expert_shard_size=8),
        engine=EngineLayout(num_replicas=8, tp=8),
    ),
    # The 2x H200 benchmark machine of the GPU issue (benchmarks/results/update_h200x2_202611.md).
    "h200x2-llama8b-bf16": _h200x2("h200x2-llama8b-bf16", "llama-3.1-8b"),
    "h200x2-llama8b-fp8": _h200x2("h200x2-llama8b-fp8", "llama-3.1-8b", fp8=True),
    "h200x2-llama8b-colocated": _h200x2("h200x2-llama8b-colocated", "llama-3.1-8b", colocated=True),
    "h200x2-qwen3-30b-bf16": _h200x2("h200x2-qwen3-30b-bf16", "qwen3-30b-a3b"),
    # Kimi-K2's structure at toy sizes: 32 trainer GPUs -> 2 replicas of 8 engine GPUs.
    "kimi-k2-mini": ClusterPreset(
        name="kimi-k2-mini",
        model="kimi-k2-mini",
        trainer=TrainerLayout(num_gpus=32, dense_shard_size=8, expert_shard_size=8),
        engine=EngineLayout(num_replicas=2, tp=4, ep=8),
    ),
    # Emulated clusters (`weight-transfer emulate`, docs/simulator.md): one host per rank.
    # 8 trainer ranks (FSDP over all 8) -> 2 BF16 replicas x tp 2.
    "emu-dense": _emu(
        "emu-dense", "emu-dense", 8, 8, 8, EngineLayout(num_replicas=2, tp=2, fp8=False)
    ),
    # The same into FP8 engines, HSDP: 2 replica meshes of 4, so quantized units are gathered.
    "emu-dense-fp8": _emu(
        "emu-dense-fp8", "emu-dense", 8, 4, 4, EngineLayout(num_replicas=2, tp=2, fp8=True)
    ),
    # MoE: HSDP meshes of 4 for dense tensors, 2 expert meshes of 4; 1 BF16 replica (tp 2, EP 4).
    "emu-moe": _emu(
        "emu-moe", "emu-moe", 8, 4, 4, EngineLayout(num_replicas=1, tp=2, ep=4, fp8=False)
    ),
}
"""Named cluster presets."""


def get_preset(name: str) -> ClusterPreset:
    """The named cluster preset.

    Raises:
        ConfigurationError: unknown name (the message lists the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown cluster preset {name!r}; known: {', '.join(sorted(PRESETS))}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Manifests
# ---------------------------------------------------------------------------------------------


def chunk_bounds(size: int, num_chunks: int) -> tuple[tuple[int, int], ...]:
    """Per-rank ``[start, stop)`` of dim 0 the way ``torch.chunk`` (and FSDP2) splits it.

    Chunks have ``ceil(size / num_chunks)`` rows; trailing chunks may be short or empty
    (an empty chunk is ``(size, size)``).
    """
    if num_chunks < 1:
        raise ValueError(f"cannot chunk into {num_chunks} parts")
    step = -(-size // num_chunks) if size else 0
    return tuple((min(size, i * step), min(size, (i + 1) * step)) for i in range(num_chunks))


def trainer_host(preset: ClusterPreset, rank: int) -> str:
    """Host name of trainer rank `rank`."""
    if preset.shared_hosts:
        return f"node{rank // preset.gpus_per_node}"
    return f"trainer-node{rank // preset.gpus_per_node}"


def engine_host(preset: ClusterPreset, index: int) -> str:
    """Host name of global engine rank `index` (replica-major)."""
    if preset.shared_hosts:
        return f"node{index // preset.gpus_per_node}"
    return f"engine-node{index // preset.gpus_per_node}"


def _params(shape: AnyShape, param_dtype: str) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, global shape, dtype, routed expert index or -1) of every trainer parameter."""
    if isinstance(shape, MlaShape):
        shapes = mla_parameter_shapes(shape)
        special = mla_source_dtypes(shape)
    else:
        shapes = hf_parameter_shapes(shape)
        special = {}
    out = []
    for name, dims in shapes.items():
        m = _EXPERT_RE.search(name)
        out.append((name, dims, special.get(name, param_dtype), int(m.group(1)) if m else -1))
    return out


def source_manifests(preset: ClusterPreset) -> list[SourceManifest]:
    """One `SourceManifest` per trainer rank of `preset` (no tensors allocated)."""
    shape = get_shape(preset.model)
    t = preset.trainer
    world = t.num_gpus
    params = _params(shape, t.dtype)
    num_experts = shape.num_experts
    num_expert_meshes = world // t.expert_shard_size
    if num_experts and num_expert_meshes > num_experts:
        raise ConfigurationError(
            f"preset {preset.name!r}: {num_expert_meshes} expert meshes for only "
            f"{num_experts} experts; raise expert_shard_size"
        )
    # Shared box objects keep 10^5-10^6 manifest entries small and fast to build.
    chunk_boxes: dict[tuple[tuple[int, ...], int], tuple[Box, ...]] = {}

    def boxes(dims: tuple[int, ...], k: int) -> tuple[Box, ...]:
        b = chunk_boxes.get((dims, k))
        if b is None:
            rest = tuple((0, n) for n in dims[1:])
            b = chunk_boxes[(dims, k)] = tuple((r, *rest) for r in chunk_bounds(dims[0], k))
        return b

    dense_meshes = [
        tuple(range(g * t.dense_shard_size, (g + 1) * t.dense_shard_size))
        for g in range(world // t.dense_shard_size)
    ]
    expert_meshes = [
        tuple(range(m * t.expert_shard_size, (m + 1) * t.expert_shard_size))
        for m in range(num_expert_meshes)
    ]
    if num_experts:
        per, extra = divmod(num_experts, num_expert_meshes)
        starts = [m * per + min(m, extra) for m in range(num_expert_meshes + 1)]
        mesh_of_expert = [0] * num_experts
        for m in range(num_expert_meshes):
            for e in range(starts[m], starts[m + 1]):
                mesh_of_expert[e] = m
    ds, es = t.dense_shard_size, t.expert_shard_size
    dense = [(name, dims, dtype, boxes(dims, ds)) for name, dims, dtype, x in params if x < 0]
    experts_by_mesh: list[list[tuple[str, tuple[int, ...], str, tuple[Box, ...]]]] = [
        [] for _ in range(num_expert_meshes)
    ]
    for name, dims, dtype, x in params:
        if x >= 0:
            experts_by_mesh[mesh_of_expert[x]].append((name, dims, dtype, boxes(dims, es)))
    device = "cuda"
    out = []
    for rank in range(world):
        g, gi = divmod(rank, ds)
        m, mi = divmod(rank, es)
        dmesh, emesh, off = dense_meshes[g], expert_meshes[m], t.offload
        tensors = [
            SourceTensor(name, dims, dtype, bx[gi], dmesh, device, off)
            for name, dims, dtype, bx in dense
        ]
        if num_experts:
            tensors.extend(
                SourceTensor(name, dims, dtype, bx[mi], emesh, device, off)
                for name, dims, dtype, bx in experts_by_mesh[m]
            )
        out.append(
            SourceManifest(
                rank=rank, world_size=world, host=trainer_host(preset, rank), tensors=tuple(tensors)
            )
        )
    return out


def _engine_recipes(shape: AnyShape, engine: EngineLayout, k: int) -> tuple[Recipe, ...]:
    tp_rank = k % engine.tp
    if isinstance(shape, MlaShape):
        return mla_recipes(
            shape,
            tp_rank=tp_rank,
            tp_size=engine.tp,
            ep_rank=k if engine.ep > 1 else 0,
            ep_size=engine.ep,
            fp8=engine.fp8,
        )
    if engine.ep > 1:
        raise ConfigurationError(
            "expert parallelism on the engine is modelled for MLA (DeepSeek/Kimi) shapes only; "
            "the vLLM preset of Llama/Qwen shapes splits experts by tensor parallelism (ep=1)"
        )
    return vllm_recipes(shape, tp_rank, engine.tp, fp8=engine.fp8)


def _specs(
    recipes: Sequence[Recipe], dtypes: dict[str, str]
) -> list[tuple[str, tuple[int, ...], str]]:
    """`planner.recipes.engine_tensor_specs` without its coverage check (the planner checks)."""
    out = []
    for rc in recipes:
        ndim = len(rc.parts[0].dest_box)
        dims = tuple(max(p.dest_box[d][1] for p in rc.parts) for d in range(ndim))
        if rc.quant is None:
            out.append((rc.dest, dims, dtypes.get(rc.dest, "bfloat16")))
        else:
            out.append((rc.dest, dims, FP8_DTYPE))
            out.append((rc.quant.scale_dest, scale_shape(dims, rc.quant.block), "float32"))
    return out


def dest_manifests(preset: ClusterPreset) -> list[DestManifest]:
    """One `DestManifest` per engine rank of `preset` (no memory allocated)."""
    shape = get_shape(preset.model)
    e = preset.engine
    dtypes = mla_engine_dtypes(shape) if isinstance(shape, MlaShape) else {}
    per_rank: dict[int, tuple[tuple[Recipe, ...], tuple[DestTensor, ...], int]] = {}
    for k in range(e.gpus_per_replica):
        recipes = _engine_recipes(shape, e, k)
        offset = 0
        tensors = []
        for name, dims, dtype in _specs(recipes, dtypes):
            tensors.append(DestTensor(name, dims, dtype, 0, offset))
            nbytes = numel(dims) * dtype_size(dtype)
            offset += -(-nbytes // _ALIGN) * _ALIGN
        per_rank[k] = (recipes, tuple(tensors), offset)
    out = []
    for r in range(e.num_replicas):
        for k in range(e.gpus_per_replica):
            recipes, rank_tensors, nbytes = per_rank[k]
            index = r * e.gpus_per_replica + k
            name = f"r{r}/ep{k}" if e.ep > 1 else f"r{r}/tp{k}"
            out.append(
                DestManifest(
                    engine=name,
                    host=engine_host(preset, index),
                    regions=(
                        DestRegion(0, max(nbytes, 8), f"sim:{name}:0".encode()),
                        DestRegion(1, 8, f"sim:{name}:version".encode()),
                    ),
                    tensors=rank_tensors,
                    recipes=recipes,
                    version_region=1,
                )
            )
    return out


def cluster_manifests(
    preset: ClusterPreset,
) -> tuple[list[SourceManifest], list[DestManifest]]:
    """Source manifests of every trainer rank and destination manifests of every engine rank.

    Raises:
        ConfigurationError: a layout the model cannot be split into (naming what).
    """
    return source_manifests(preset), dest_manifests(preset)


def with_overrides(preset: ClusterPreset, **changes: object) -> ClusterPreset:
    """A copy of `preset` with fields of it, its trainer, engine or rates replaced.

    Keys are ``trainer.<field>``, ``engine.<field>``, ``rates.<field>`` or a top-level field.

    Raises:
        ValueError: an unknown key or a bad value.
    """
    parts: dict[str, dict[str, object]] = {"trainer": {}, "engine": {}, "rates": {}, "": {}}
    for key, value in changes.items():
        scope, _, field = key.rpartition(".")
        if scope not in parts:
            raise ValueError(f"unknown override {key!r}")
        parts[scope][field] = value
    replace: Callable[..., object] = dataclasses.replace
    try:
        top = dict(parts[""])
        for scope in ("trainer", "engine", "rates"):
            if parts[scope]:
                top[scope] = replace(getattr(preset, scope), **parts[scope])
        return dataclasses.replace(preset, **top)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ValueError(f"bad override: {exc}") from None


def model_bytes(preset: ClusterPreset) -> tuple[int, int]:
    """(trainer bytes of one model copy, engine bytes of one replica)."""
    shape = get_shape(preset.model)
    train = sum(numel(d) * dtype_size(dt) for _, d, dt, _ in _params(shape, preset.trainer.dtype))
    engine = 0
    for dm in dest_manifests(
        dataclasses.replace(preset, engine=dataclasses.replace(preset.engine, num_replicas=1))
    ):
        engine += sum(numel(t.shape) * dtype_size(t.dtype) for t in dm.tensors)
    return train, engine


def engine_names(preset: ClusterPreset) -> Sequence[str]:
    """Engine rank names of `preset`, in manifest order."""
    e = preset.engine
    tag = "ep" if e.ep > 1 else "tp"
    return [f"r{r}/{tag}{k}" for r in range(e.num_replicas) for k in range(e.gpus_per_replica)]


__all__ = [
    "ClusterPreset",
    "EMU_RATES",
    "EMU_SHAPES",
    "EngineLayout",
    "H200X2_RATES",
    "LARGE_SHAPES",
    "PRESETS",
    "SMALL_MLA",
    "TrainerLayout",
    "chunk_bounds",
    "cluster_manifests",
    "dest_manifests",
    "engine_host",
    "engine_names",
    "get_preset",
    "get_shape",
    "model_bytes",
    "source_manifests",
    "trainer_host",
    "with_overrides",
]
