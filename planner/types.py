"""The planner's data: manifests in, recipes as data, the static schedule out.

Everything here is a frozen dataclass of plain values, encodable with `planner.codec` (msgpack
on the wire, canonical JSON on disk). Shapes are tuples of ints, dtypes are torch dtype names
without the `torch.` prefix ("bfloat16", "float8_e4m3fn"), boxes are per-dimension half-open
`[start, stop)` ranges in the coordinates of the tensor they index.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Range = tuple[int, int]
Box = tuple[Range, ...]

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Element size in bytes of every dtype a manifest may name."""

FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})
"""Dtypes a recipe may cast between (high precision floats)."""


def dtype_size(dtype: str) -> int:
    """Bytes per element of `dtype`.

    Raises:
        ValueError: unknown dtype.
    """
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a shape."""
    return math.prod(shape)


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of a box per dimension."""
    return tuple(b - a for a, b in box)


def full_box(shape: tuple[int, ...]) -> Box:
    """The box covering a whole tensor."""
    return tuple((0, n) for n in shape)


def box_intersection(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of equal rank, or None if empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_in(inner: Box, outer: Box) -> bool:
    """True if `inner` lies inside `outer`."""
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer, strict=True))


def squeeze_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape without its size-1 dimensions (recipes may add or drop unit dims)."""
    return tuple(n for n in shape if n != 1)


# ---------------------------------------------------------------------------------------------
# Manifests
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SourceTensor:
    """One trainer parameter as one rank holds it."""

    name: str
    """Trainer-side name (HF convention for the presets)."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    local_box: Box | None
    """Global coordinates of this rank's local shard; None when the shard is not a box
    (strided sharding): the planner must gather."""
    mesh: tuple[int, ...]
    """Global ranks that rebuild this tensor together with `full_tensor()` (sorted). A plain,
    non-distributed tensor has the mesh `(rank,)`."""
    device: str
    """"cpu" or "cuda" for the trainer's compute device."""
    offloaded: bool = False
    """True when the local shard lives in host memory while the trainer computes on a GPU."""
    aliases: tuple[str, ...] = ()
    """Other names of this same parameter (tied weights: ``lm_head.weight`` of a model whose
    LM head shares the embedding's). A recipe may read the tensor under any of its names; it
    is one source, sent once per engine tensor that reads it, and an alias that no recipe reads
    is not an extra tensor."""


@dataclasses.dataclass(frozen=True, slots=True)
class SourceManifest:
    """What one trainer rank can send."""

    rank: int
    world_size: int
    host: str
    tensors: tuple[SourceTensor, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class DestRegion:
    """One registered memory region of an engine rank."""

    index: int
    nbytes: int
    descriptor: bytes
    """`backends.base.RegionDescriptor.to_bytes()`."""


@dataclasses.dataclass(frozen=True, slots=True)
class DestTensor:
    """One engine tensor, contiguous inside a registered region."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    region: int
    offset_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """A box of a source tensor that lands in a box of a destination tensor.

    The two boxes have the same shape once size-1 dimensions are dropped (so a 2-D expert
    matrix can land in one slice of a stacked 3-D tensor).
    """

    source: str
    source_box: Box
    dest_box: Box


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8BlockQuant:
    """FP8 e4m3 block quantization of the assembled destination.

    The destination (float8_e4m3fn) is quantized per `block` of its last two dimensions (leading
    dimensions, such as experts, are independent); `scale_dest` receives float32 dequantization
    scales (amax / 448) of shape `(*leading, ceil(rows/b0), ceil(cols/b1))`.
    """

    scale_dest: str
    block: tuple[int, int] = (128, 128)


@dataclasses.dataclass(frozen=True, slots=True)
class SourceSpec:
    """What a recipe expects of one trainer tensor it reads: its global shape and dtype.

    The planner checks every trainer tensor against the specs of every recipe that reads it
    and refuses the plan, listing each mismatch, before any byte moves: a trainer tensor of
    another shape is never silently cut to the boxes a recipe reads.
    """

    name: str
    """Trainer-side name."""
    shape: tuple[int, ...]
    """The global shape the recipe was built for."""
    dtype: str | None = None
    """The dtype required; None accepts any float dtype (`FLOAT_DTYPES`), cast on the way to
    the engine tensor's dtype (the presets: bf16 or fp32 trainers into any float engine)."""
    padded_dims: tuple[int, ...] = ()
    """Dimensions along which the trainer may hold more than `shape`: trailing padding that no
    part reads (a trainer's padded vocabulary). Accepted only with
    `PlannerConfig.allow_source_padding`; otherwise any other size is a mismatch."""


@dataclasses.dataclass(frozen=True, slots=True)
class Recipe:
    """How to build one engine tensor from trainer tensors: its parts and an optional transform.

    Without a transform each part is copied (and cast between float dtypes if they differ).
    The parts must cover the destination exactly once.
    """

    dest: str
    parts: tuple[Part, ...]
    quant: Fp8BlockQuant | None = None
    sources: tuple[SourceSpec, ...] = ()
    """The expected shape (and dtype) of every trainer tensor the parts read, one entry per
    name. The builders in `planner.recipes` fill it; the planner refuses a recipe whose parts
    read a tensor it does not declare."""


@dataclasses.dataclass(frozen=True, slots=True)
class DestManifest:
    """What one engine rank exposes: regions, tensors inside them, and their recipes."""

    engine: str
    """Unique engine-rank name, e.g. "engine0" or "replica1/tp3"."""
    host: str
    regions: tuple[DestRegion, ...]
    tensors: tuple[DestTensor, ...]
    recipes: tuple[Recipe, ...]
    version_region: int
    """Index of the 8-byte region holding the last completed update number (int64)."""


# ---------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WriteRun:
    """A contiguous byte range in an engine's region."""

    region: int
    offset_bytes: int
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class SliceWrite:
    """Copy `source_box` of a source tensor into `dest_box` of an engine tensor.

    The sender packs the box (cast to `dtype`) in the row-major order of `dest_box` and writes
    it as `runs`, which follow each other in that order.
    """

    engine: str
    dest: str
    source: str
    source_box: Box
    dest_box: Box
    dtype: str
    runs: tuple[WriteRun, ...]
    zero_copy: bool
    """Write straight from the registered local shard: same dtype, and `source_box` is one
    contiguous byte range of the local shard that lands in one run."""

    @property
    def nbytes(self) -> int:
        """Bytes this write puts on the wire."""
        return sum(r.nbytes for r in self.runs)


@dataclasses.dataclass(frozen=True, slots=True)
class QuantWrite:
    """Assemble `dest_box` of an FP8 engine tensor from gathered sources, quantize, write both.

    `parts` are restricted to `dest_box` (their dest boxes are in the coordinates of the whole
    engine tensor). The quantized block goes to `weight_runs`, its scales to `scale_runs`.
    """

    engine: str
    dest: str
    scale_dest: str
    block: tuple[int, int]
    parts: tuple[Part, ...]
    dest_box: Box
    scale_box: Box
    weight_runs: tuple[WriteRun, ...]
    scale_runs: tuple[WriteRun, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this write puts on the wire."""
        return sum(r.nbytes for r in self.weight_runs) + sum(r.nbytes for r in self.scale_runs)


def staging_key(w: SliceWrite | QuantWrite) -> tuple[object, ...] | None:
    """What a write's staged bytes are made of; None for a zero-copy write (it stages nothing).

    Engine replicas receive the same bytes: writes of one task with equal keys stage (and
    quantize) the same bytes, so the executor prepares them once and every replica's writes
    read that one copy, and the planner and the simulator count them once."""
    if isinstance(w, QuantWrite):
        return ("quant", w.block, w.parts, w.dest_box, w.scale_box)
    if w.zero_copy:
        return None
    return ("slice", w.source, w.source_box, w.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One unit of the pipeline on one trainer rank.

    A "direct" task sends from the rank's own shard. A "gather" task first rebuilds `gather`
    with `full_tensor()` on `mesh`; every rank of that mesh runs it, in the same position of
    its schedule, even when it has no writes of its own in it.
    """

    task_id: int
    kind: Literal["direct", "gather"]
    mesh_group: int
    mesh: tuple[int, ...]
    gather: tuple[str, ...]
    writes: tuple[SliceWrite | QuantWrite, ...]
    staging_bytes: int
    """Registered staging memory this rank's writes of the task need at once."""
    scratch_bytes: int
    """Unregistered temporary memory (gathered full tensors, high-precision assembly)."""
    h2d_bytes: int = 0
    """Bytes copied host-to-device first (CPU-offloaded sources on a GPU trainer)."""

    @property
    def nbytes(self) -> int:
        """Bytes this task puts on the wire."""
        return sum(w.nbytes for w in self.writes)


@dataclasses.dataclass(frozen=True, slots=True)
class RankSchedule:
    """Everything one trainer rank does per update, in order."""

    rank: int
    tasks: tuple[Task, ...]
    peers: tuple[str, ...]
    """Engines this rank writes to (connect once at setup)."""
    version_engines: tuple[str, ...]
    """Engines whose version word this rank writes after every update completed."""
    memory_budget_bytes: int
    """The temporary memory this schedule was planned for (`PlannerConfig.memory_budget_bytes`);
    the rank's executor runs within it, so planner and executor cannot disagree."""
    num_mesh_groups: int = 1
    """Mesh groups of the whole schedule: every rank enters every group's barrier."""


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """The static plan: computed once, replayed every update. Same input, same JSON bytes."""

    format_version: int
    fingerprint: str
    """sha256 of the canonical encoding of the inputs."""
    num_ranks: int
    engines: tuple[str, ...]
    num_mesh_groups: int
    ranks: tuple[RankSchedule, ...]
    bytes_per_rank: tuple[int, ...]
    bytes_per_engine: tuple[int, ...]

    def for_rank(self, rank: int) -> RankSchedule:
        """The part of the schedule one trainer rank runs."""
        return self.ranks[rank]
