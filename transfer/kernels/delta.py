"""Diff/encode and apply kernels of delta updates (torch ops on the CPU, Triton on a GPU).

What changed between the bytes last sent (the *snapshot*) and the new engine bytes of one
contiguous run of elements is encoded as a *sparse chunk list*: the run is cut into chunks of
`CHUNK_ELEMENTS` (65,536) elements; the chunks' offsets, int64, the exclusive prefix sum of the
per-chunk change counts (one entry more than chunks); then, chunk after chunk, each changed
element's 16-bit index inside its chunk and its new value (the element's bytes: 1 for FP8, 2 for
BF16, 4 for float32 scales). On the wire (`weight_transfer.delta.patch`) that is
``2 + value_bytes`` bytes per changed element plus 8 bytes per chunk and one, indices and values
each padded to 8 bytes; a run whose encoding would not be smaller than the run itself is sent
dense instead (the caller decides from the exact size; `sparse_nbytes` is the simulator's
model, which counts 4 bytes per chunk).

Comparison is bitwise (the tensors are viewed as integers of their element size), so -0.0 vs
0.0 and NaN payloads count as changes and the result is bit-exact by construction.

Kernels, each over a flat contiguous 1-D tensor viewed as int8/int16/int32:

* `count_changes(new, old, counts)`: changed elements per chunk.
* `encode_changes(new, old, offsets, index, values)`: write every chunk's indices and values at
  its offset (``offsets`` = exclusive prefix sum of the counts, one more entry than chunks).
* `apply_changes(dst, offsets, index, values)`: ``dst[chunk * CHUNK + index] = value``.
* `diff_encode` runs the first two with a capacity check in between.

No full-size temporaries: the CPU path works on groups of `_CPU_GROUP_CHUNKS` chunks (its
temporaries are bounded by that group, not by the tensor); the Triton kernels keep one tile per
program in registers. Each program of a Triton kernel owns one chunk, so encoding is
deterministic (entries in index order) and apply never has two writers of one element.

`ENCODINGS` / `encoded_nbytes` give the wire size of the other encodings that were measured
against this one (`benchmarks/bench_delta_density.py`): they are not implemented as kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from weight_transfer.config import DELTA_KERNELS
from weight_transfer.errors import ConfigurationError, WeightTransferError
from weight_transfer.planner.delta import CHUNK_ELEMENTS, num_chunks, sparse_nbytes

__all__ = [
    "CHUNK_ELEMENTS",
    "ENCODINGS",
    "KERNELS",
    "CountedRuns",
    "CountedTable",
    "apply_changes",
    "apply_runs",
    "apply_table",
    "count_changes",
    "count_runs",
    "count_table",
    "diff_encode",
    "encode_changes",
    "encode_runs",
    "encode_table",
    "encoded_nbytes",
    "int_view",
    "num_chunks",
    "sparse_nbytes",
    "use_kernels",
    "uses_triton",
]

_CPU_GROUP_CHUNKS = 64
"""Chunks the CPU path handles at once (bounds its temporaries to 4 Mi elements)."""

_TILE = 1024
"""Elements one Triton program step reads."""

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_JIT_MODULE = "weight_transfer.kernels._delta_triton_jit"
_CUDA_MODULE = "weight_transfer.kernels._delta_cuda"

logger = logging.getLogger(__name__)

ENCODINGS = (
    "index32",
    "chunk_index16",
    "bitmap",
    "hybrid16",
    "runs256",
    "blocks128",
)
"""Encodings whose wire size `encoded_nbytes` computes: `index32` (global 32-bit index + value
per change), `chunk_index16` (this module's format), `bitmap` (one bit per element + the
changed values), `hybrid16` (per chunk the smaller of chunk_index16 and bitmap), `runs256`
(every 256-element run with a change sent whole, plus a bitmap of runs), `blocks128` (every
128x128 block of the last two dims with a change sent whole, plus a 4-byte block index)."""


def int_view(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) as a flat tensor of signed integers of its element size."""
    if not t.is_contiguous():
        raise ConfigurationError(f"delta kernels need contiguous tensors, got strides {t.stride()}")
    dtype = _INT_OF_SIZE.get(t.element_size())
    if dtype is None:
        raise ConfigurationError(f"no integer view for element size {t.element_size()}")
    return t.reshape(-1).view(dtype)


def encoded_nbytes(encoding: str, changed: torch.Tensor, *, value_bytes: int) -> int:
    """Wire bytes of `encoding` for a bool mask of changed elements (`ENCODINGS`)."""
    n = int(changed.sum())
    numel = changed.numel()
    if encoding == "index32":
        return (4 + value_bytes) * n
    if encoding == "chunk_index16":
        return sparse_nbytes(n, numel, value_bytes)
    if encoding == "bitmap":
        return math.ceil(numel / 8) + value_bytes * n
    if encoding == "hybrid16":
        flat = changed.reshape(-1)
        total = 0
        for start in range(0, numel, CHUNK_ELEMENTS):
            part = flat[start : start + CHUNK_ELEMENTS]
            k = int(part.sum())
            total += 4 + value_bytes * k + min(2 * k, math.ceil(part.numel() / 8))
        return total
    if encoding == "runs256":
        flat = changed.reshape(-1)
        pad = (-numel) % 256
        runs = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, 256).any(dim=1)
        return math.ceil(runs.numel() / 8) + int(runs.sum()) * 256 * value_bytes
    if encoding == "blocks128":
        t = changed if changed.dim() >= 2 else changed.reshape(1, -1)
        *lead, rows, cols = t.shape
        nr, nc = math.ceil(rows / 128), math.ceil(cols / 128)
        padded = torch.nn.functional.pad(t, (0, nc * 128 - cols, 0, nr * 128 - rows))
        blocks = padded.reshape(*lead, nr, 128, nc, 128)
        anyb = blocks.any(dim=-1).any(dim=-2)
        # Each changed block is sent whole: its elements that exist (edge blocks are partial).
        sizes = torch.ones_like(padded, dtype=torch.int64)
        sizes[..., rows:, :] = 0
        sizes[..., :, cols:] = 0
        per_block = sizes.reshape(*lead, nr, 128, nc, 128).sum(dim=(-3, -1))
        return int((per_block * anyb).sum()) * value_bytes + 4 * int(anyb.sum())
    raise ValueError(f"unknown encoding {encoding!r}; known: {ENCODINGS}")


@functools.cache
def _jit() -> ModuleType:
    try:
        return importlib.import_module(_JIT_MODULE)
    except ImportError as exc:
        raise WeightTransferError(
            f"the GPU delta kernels need triton, which could not be imported ({exc}); install "
            "it with `pip install triton` (it ships with CUDA builds of torch)"
        ) from exc


KERNELS = DELTA_KERNELS
"""Which kernels the table functions (`count_table`, `encode_table`, `apply_table`) run on a
GPU (`use_kernels`): "cuda" the CUDA C kernels of `_delta_cuda` (compiled at first use by
NVRTC through CuPy), "triton" the Triton kernels, "auto" CUDA C when CuPy can be imported
and compiles them for the device (else Triton, with a warning saying why). The single-run
kernels (`count_changes`, `encode_changes`, `apply_changes`) are Triton's."""

_kernels = "auto"


def use_kernels(name: str) -> None:
    """Select the GPU table kernels for this process (`KERNELS`); "cuda" without CuPy raises
    at the first launch."""
    global _kernels
    if name not in KERNELS:
        raise ConfigurationError(f"delta kernels must be one of {KERNELS}, got {name!r}")
    _kernels = name


def _cuda_kernels(device: torch.device) -> ModuleType | None:
    """The `_delta_cuda` module when it runs the table kernels on `device`, else None."""
    if device.type != "cuda" or _kernels == "triton":
        return None
    module = _cuda_module(_kernels == "cuda")
    if module is None or _kernels == "cuda":
        return module
    index = device.index if device.index is not None else torch.cuda.current_device()
    return module if _cuda_compiles(module, index) else None


@functools.cache
def _cuda_compiles(module: ModuleType, device_index: int) -> bool:
    """Whether the CUDA C kernels compile for a device ("auto" falls back to Triton where
    they do not: a CuPy built for another CUDA, no NVRTC); compiled once per device."""
    try:
        module._module(device_index, ())  # the launches' cache key: compiled once
    except Exception as exc:  # CuPy's compile and driver errors have no common base
        logger.warning(
            "delta kernels: the CUDA C kernels did not compile for cuda:%d (%s: %s); using "
            'the Triton kernels (set kernels = "triton" to skip this attempt)',
            device_index,
            type(exc).__name__,
            exc,
        )
        return False
    return True


@functools.cache
def _cuda_module(required: bool) -> ModuleType | None:
    try:
        return importlib.import_module(_CUDA_MODULE)
    except ImportError as exc:
        if required:
            raise WeightTransferError(
                f"the CUDA C delta kernels need cupy, which could not be imported ({exc}); "
                "install the CuPy build of your CUDA (`pip install cupy-cuda12x` or "
                "`cupy-cuda13x`) or select the Triton kernels"
            ) from exc
        return None


def _module_version(name: str) -> str | None:
    """`name`'s version if it imports, else None."""
    try:
        return str(getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError:
        return None


def kernels_report(device_index: int) -> str:
    """Which table kernels delta mode runs on cuda:`device_index` with this process's selection
    (`use_kernels`), and why: one line, for `weight-transfer doctor`. Compiles the CUDA C
    kernels where "auto" would (a fraction of a second with NVRTC)."""
    try:
        cu = _cuda_kernels(torch.device("cuda", device_index))
    except WeightTransferError as exc:  # "cuda" selected, CuPy missing
        return f"none: {exc}"
    if cu is not None:
        return f"CUDA C (CuPy {_module_version('cupy')}, kernels = {_kernels!r})"
    if _kernels == "triton":
        why = 'kernels = "triton"'
    elif _cuda_module(False) is None:
        why = (
            "CuPy does not import; `pip install 'weight-transfer[cuda13]'` (or [cuda12]) "
            "for the faster CUDA C kernels"
        )
    else:
        why = f"the CUDA C kernels do not compile for cuda:{device_index} (logged above)"
    triton = _module_version("triton")
    if triton is None:
        return f"none: triton does not import, and {why}"
    return f"Triton {triton} ({why})"


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the kernels run as Triton for `t` (CUDA tensors; CPU tensors under triton's
    interpreter, `TRITON_INTERPRET=1`), else as torch ops."""
    return _use_triton(t)


def _use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors take the Triton kernels; CPU tensors too when triton runs interpreted."""
    if t.is_cuda:
        return True
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    kernel = _jit().count_kernel
    return type(kernel).__name__ == "InterpretedFunction"


def _check_pair(new: torch.Tensor, old: torch.Tensor) -> None:
    for what, t in (("new", new), ("old", old)):
        if t.dim() != 1 or t.dtype not in _INT_OF_SIZE.values():
            raise ConfigurationError(
                f"delta kernels take flat integer views (`int_view`); {what} is "
                f"{t.dtype} of shape {tuple(t.shape)}"
            )
    if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
        raise ConfigurationError(
            f"new ({new.dtype}, {tuple(new.shape)}, {new.device}) and old "
            f"({old.dtype}, {tuple(old.shape)}, {old.device}) differ"
        )


def _launch(kernel: Any, grid: int, *args: Any) -> None:
    if grid == 0:
        return
    device = args[0].device
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[(grid,)](*args, CHUNK=CHUNK_ELEMENTS, TILE=_TILE)
    else:
        kernel[(grid,)](*args, CHUNK=CHUNK_ELEMENTS, TILE=_TILE)


def count_changes(new: torch.Tensor, old: torch.Tensor, counts: torch.Tensor) -> None:
    """Write the number of elements of each chunk where `new` and `old` differ into `counts`
    (int64, `num_chunks(numel)` entries, on their device). Asynchronous on a GPU."""
    _check_pair(new, old)
    n = new.numel()
    if counts.dtype != torch.int64 or counts.numel() != num_chunks(n):
        raise ConfigurationError(f"counts must be int64 of {num_chunks(n)} entries")
    if _use_triton(new):
        _launch(_jit().count_kernel, num_chunks(n), new, old, counts, n)
        return
    group = _CPU_GROUP_CHUNKS * CHUNK_ELEMENTS
    for start in range(0, n, group):
        ne = new[start : start + group] != old[start : start + group]
        c0 = start // CHUNK_ELEMENTS
        whole = ne.numel() // CHUNK_ELEMENTS
        if whole:
            counts[c0 : c0 + whole] = torch.count_nonzero(
                ne[: whole * CHUNK_ELEMENTS].view(whole, -1), dim=1
            )
        if ne.numel() % CHUNK_ELEMENTS:
            counts[c0 + whole] = torch.count_nonzero(ne[whole * CHUNK_ELEMENTS :])


def encode_changes(
    new: torch.Tensor,
    old: torch.Tensor,
    offsets: torch.Tensor,
    index: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write each changed element's index in its chunk (int16 bit patterns of a uint16) and its
    value, chunk after chunk, starting at ``offsets[chunk]`` (int64, one entry more than chunks:
    the exclusive prefix sum of `count_changes`). `index` and `values` hold at least
    ``offsets[-1]`` entries. Asynchronous on a GPU."""
    _check_pair(new, old)
    n = new.numel()
    if offsets.dtype != torch.int64 or offsets.numel() != num_chunks(n) + 1:
        raise ConfigurationError(f"offsets must be int64 of {num_chunks(n) + 1} entries")
    if index.dtype != torch.int16 or values.dtype != new.dtype:
        raise ConfigurationError(
            f"index must be int16 and values {new.dtype}; got {index.dtype} and {values.dtype}"
        )
    if _use_triton(new):
        _launch(_jit().encode_kernel, num_chunks(n), new, old, offsets, index, values, n)
        return
    group = _CPU_GROUP_CHUNKS * CHUNK_ELEMENTS
    for start in range(0, n, group):
        a, b = new[start : start + group], old[start : start + group]
        idx = (a != b).nonzero().reshape(-1)
        if idx.numel() == 0:
            continue
        base = int(offsets[start // CHUNK_ELEMENTS])
        # Entries of a group are contiguous: its chunks' offsets follow each other.
        # The low 16 bits of the position are its index in its chunk (a uint16 stored as int16).
        index[base : base + idx.numel()] = (idx & (CHUNK_ELEMENTS - 1)).to(torch.int16)
        values[base : base + idx.numel()] = a[idx]


def apply_changes(
    dst: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> None:
    """``dst[chunk * CHUNK_ELEMENTS + index[j]] = values[j]`` for every entry j of every chunk
    (``offsets`` as `encode_changes` takes it). In place; asynchronous on a GPU."""
    if dst.dim() != 1 or dst.dtype not in _INT_OF_SIZE.values() or values.dtype != dst.dtype:
        raise ConfigurationError(
            f"apply takes a flat integer view and values of its dtype; got {dst.dtype} "
            f"{tuple(dst.shape)} and values {values.dtype}"
        )
    n = dst.numel()
    if offsets.dtype != torch.int64 or offsets.numel() != num_chunks(n) + 1:
        raise ConfigurationError(f"offsets must be int64 of {num_chunks(n) + 1} entries")
    if index.dtype != torch.int16:
        raise ConfigurationError(f"index must be int16, got {index.dtype}")
    if _use_triton(dst):
        _launch(_jit().apply_kernel, num_chunks(n), dst, offsets, index, values, n)
        return
    total = int(offsets[-1])
    if total == 0:
        return
    counts = offsets[1:] - offsets[:-1]
    for c0 in range(0, num_chunks(n), _CPU_GROUP_CHUNKS):
        c1 = min(c0 + _CPU_GROUP_CHUNKS, num_chunks(n))
        lo, hi = int(offsets[c0]), int(offsets[c1])
        if lo == hi:
            continue
        chunk_of = torch.repeat_interleave(
            torch.arange(c0, c1, dtype=torch.int64), counts[c0:c1].to(torch.int64)
        )
        pos = chunk_of * CHUNK_ELEMENTS + (index[lo:hi].to(torch.int64) & 0xFFFF)
        if int(pos.max()) >= n or int(pos.min()) < 0:
            raise ConfigurationError(f"patch entry outside the run of {n} elements")
        dst.scatter_(0, pos, values[lo:hi])


def diff_encode(
    new: torch.Tensor,
    old: torch.Tensor,
    *,
    index: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
) -> int:
    """Count, check capacity, encode. Returns the number of changed elements; when it exceeds
    the capacity of `index`/`values`, nothing but `offsets` is written (send the run dense).

    `offsets` (int64, `num_chunks + 1`) receives the exclusive prefix sum of the counts. On a
    GPU this synchronizes once (to read the total).
    """
    _check_pair(new, old)
    chunks = num_chunks(new.numel())
    if offsets.dtype != torch.int64 or offsets.numel() != chunks + 1:
        raise ConfigurationError(f"offsets must be int64 of {chunks + 1} entries")
    offsets[0] = 0
    if _use_triton(new):
        counts = offsets[1:]
        count_changes(new, old, counts)
        torch.cumsum(counts, 0, out=counts)
        total = int(offsets[-1])
        if total > min(index.numel(), values.numel()):
            return total
        encode_changes(new, old, offsets, index, values)
        return total
    # CPU: one pass (compare, nonzero) per group of chunks, writing while it fits.
    capacity = min(index.numel(), values.numel())
    n = new.numel()
    group = _CPU_GROUP_CHUNKS * CHUNK_ELEMENTS
    total = 0
    for start in range(0, n, group):
        a = new[start : start + group]
        idx = (a != old[start : start + group]).nonzero().reshape(-1)
        c0, k = start // CHUNK_ELEMENTS, num_chunks(a.numel())
        counts = (
            torch.bincount(idx >> 16, minlength=k)
            if idx.numel()
            else torch.zeros(k, dtype=torch.int64)
        )
        offsets[c0 + 1 : c0 + k + 1] = torch.cumsum(counts, 0) + total
        if idx.numel() and total + idx.numel() <= capacity:
            index[total : total + idx.numel()] = (idx & (CHUNK_ELEMENTS - 1)).to(torch.int16)
            values[total : total + idx.numel()] = a[idx]
        total += idx.numel()
    return total


# -- tables: one launch over many runs (GPU) -------------------------------------------------
# Per-run launches and synchronizations dominate an update of hundreds of runs (a model's
# tensors, an MoE's experts), so on a GPU a batch of runs is counted with one launch per
# element size, the counts read with one synchronization, encoded with one more launch per
# element size, and a whole patch applied with one launch per element size. Each program owns
# one chunk of one run and finds its run by binary search in a table of runs (device
# addresses, int64 words; one small host-to-device copy per launch). The count pass also
# writes the change bitmap (one bit per element: scratch of 1/8 byte per element, the only
# buffer proportional to the runs), so the encode pass reads the bitmap and only the changed
# elements of the new run, walking set bits (work per block of words: its fullest word's
# set bits, nothing for a block without changes): count + encode read each run about once.
# Two kernel sets do this (`use_kernels`): the Triton kernels below, and CUDA C kernels
# (`_delta_cuda`, through CuPy) that also stage a chunk's first changes during the count so
# that the encode copies them instead of gathering them; both write the same bytes.

_COUNT_TILE = 4096
"""Elements one step of a count program compares."""
_ENCODE_BLOCK = 128
"""Bitmap words one step of an encode program reads (128 with 4 warps: 0.83 ms per 4 GiB of
BF16 at 0.78% changed on an H200, against 1.44 ms with 64; 256 and 512 were not faster
there: benchmarks/results/archive/delta_h200_202612_s3_encode_block.json)."""
_APPLY_TILE = 1024
"""Entries one step of an apply program scatters."""
_COUNT_WARPS, _ENCODE_WARPS, _APPLY_WARPS = 8, 4, 4
_WORDS = CHUNK_ELEMENTS // 32

_TRITON_INT = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _tl_dtype(esize: int) -> Any:
    tl = importlib.import_module("triton.language")
    return getattr(tl, _TRITON_INT[esize])


def _device_table(
    runs: Sequence[Sequence[int]] | np.ndarray,
    chunks: Sequence[int] | np.ndarray,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """Rows of `runs` (int64 fields) and their first chunks on `device` (one host-to-device
    copy, asynchronous on a GPU): (rows, first, runs, total chunks), or None when there is no
    chunk."""
    table = np.asarray(runs, dtype=np.int64)
    if table.shape[0] == 0:
        return None
    first = np.zeros(table.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.asarray(chunks, dtype=np.int64), out=first[1:])
    total = int(first[-1])
    if total == 0:
        return None
    host = torch.from_numpy(np.concatenate([table.reshape(-1), first]))
    if device.type == "cuda":
        # From pinned memory without waiting: a copy from pageable memory would hold the host
        # until the stream's earlier work is done. torch's pinned-memory cache keeps the
        # buffer until the copy has run.
        on = host.pin_memory().to(device, non_blocking=True)
    else:
        on = host.to(device)
    return on[: table.size], on[table.size :], int(table.shape[0]), total


def _run_launch(
    kernel: Any,
    runs: Sequence[Sequence[int]] | np.ndarray,
    chunks: Sequence[int] | np.ndarray,
    device: torch.device,
    *args: Any,
    num_warps: int,
    cuda: tuple[str, Any] | None = None,
    cuda_module: ModuleType | None = None,
    **meta: Any,
) -> None:
    """Launch `kernel` over every chunk of `runs` (rows of int64 fields; `chunks` per run); on a
    GPU with the CUDA C kernels selected (`use_kernels`), or `cuda_module` given, ``cuda`` =
    (function of `_delta_cuda`, its keyword arguments) instead."""
    on = _device_table(runs, chunks, device)
    if on is None:
        return
    runs_t, first_t, num_runs, total = on
    cu = cuda_module
    if cu is None and cuda is not None:
        cu = _cuda_kernels(device)
    if cu is not None and cuda is not None:
        fn, kw = cuda
        getattr(cu, fn)(device, runs_t, first_t, num_runs, total, *args, **kw)
        return
    log = max(1, num_runs.bit_length())
    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        kernel[(total,)](runs_t, first_t, num_runs, *args, LOG=log, num_warps=num_warps, **meta)


def apply_table(device: torch.device, elem_size: int, table: np.ndarray) -> None:
    """`apply_runs` from device addresses: rows of int64 [dst, offsets, index, values, numel]
    (one sparse chunk list per row, all of element size `elem_size`, offsets validated by the
    caller). One launch, asynchronous. For callers that know many segments' addresses by
    arithmetic (an engine's patch region): no tensor view per segment."""
    if table.shape[0] == 0:
        return
    rows = np.zeros((table.shape[0], 8), dtype=np.int64)
    rows[:, :5] = table[:, :5]
    _run_launch(
        _jit().apply_runs_kernel,
        rows,
        (rows[:, 4] + CHUNK_ELEMENTS - 1) // CHUNK_ELEMENTS,
        device,
        num_warps=_APPLY_WARPS,
        cuda=("apply_rows", {"esize": elem_size}),
        DTYPE=_tl_dtype(elem_size),
        CHUNK=CHUNK_ELEMENTS,
        TILE=_APPLY_TILE,
    )


@dataclasses.dataclass(kw_only=True, slots=True)
class CountedTable:
    """What `count_table` found: changed elements per chunk (on the host) of every run of a
    table, and the device scratch `encode_table` reads. Keep it until `encode_table`
    returned."""

    new_ptr: np.ndarray
    """Each run's new bytes (device addresses)."""
    numel: np.ndarray
    esize: np.ndarray
    first_row: np.ndarray
    """Row (global chunk index) of each run's first chunk; one more entry: the rows."""
    counts: np.ndarray
    """Changed elements per row (int64)."""
    device_counts: torch.Tensor
    wbits: torch.Tensor
    whole: np.ndarray
    """Chunks of each run counted as whole chunks (16-byte aligned, unmasked)."""
    staging: dict[int, Any] = dataclasses.field(default_factory=dict)
    """The CUDA C kernels' staged changes per element size (`_delta_cuda.Staging`); empty
    under Triton."""
    stage_row0: np.ndarray | None = None
    """Each run's first staging row (in its element size's `staging`); None under Triton."""
    cuda: ModuleType | None = None
    """The CUDA C kernels that counted, which must also encode (their bitmap holds only the
    words past each whole chunk's staged changes); None under Triton."""

    @property
    def totals(self) -> np.ndarray:
        """Changed elements per run (int64)."""
        inclusive = np.zeros(self.counts.size + 1, dtype=np.int64)
        np.cumsum(self.counts, out=inclusive[1:])
        out: np.ndarray = inclusive[self.first_row[1:]] - inclusive[self.first_row[:-1]]
        return out


def count_table(
    device: torch.device,
    new_ptr: np.ndarray,
    old_ptr: np.ndarray,
    numel: np.ndarray,
    esize: np.ndarray,
) -> CountedTable:
    """Count the changed elements of every chunk of every run given by addresses: run i
    compares `numel[i]` elements of `esize[i]` bytes at `new_ptr[i]` with those at
    `old_ptr[i]` (device memory of `device`, the caller keeps it alive; numel > 0). One launch
    per element size and alignment (whole chunks of 16-byte aligned runs unmasked), then one
    synchronization to read the counts. Host work is numpy over the table, none per run."""
    new_ptr, old_ptr = np.asarray(new_ptr, np.int64), np.asarray(old_ptr, np.int64)
    numel, esize = np.asarray(numel, np.int64), np.asarray(esize, np.int64)
    chunks = (numel + CHUNK_ELEMENTS - 1) // CHUNK_ELEMENTS
    first_row = np.zeros(numel.size + 1, dtype=np.int64)
    np.cumsum(chunks, out=first_row[1:])
    rows = int(first_row[-1])
    counts = torch.empty(rows, dtype=torch.int64, device=device)
    wbits = torch.empty(rows * _WORDS, dtype=torch.int32, device=device)
    aligned = (new_ptr % 16 == 0) & (old_ptr % 16 == 0)
    whole = np.where(aligned, numel // CHUNK_ELEMENTS, 0)
    cu = _cuda_kernels(device)
    staging: dict[int, Any] = {}
    stage_row0 = np.zeros(numel.size, dtype=np.int64) if cu is not None else None
    step = whole * CHUNK_ELEMENTS
    for size in np.unique(esize).tolist():
        of = esize == size
        # The whole chunks of aligned runs (no mask), then every other chunk (a run's
        # partial last chunk; every chunk of an unaligned run) masked.
        for full, sel in ((True, of & (whole > 0)), (False, of & (chunks > whole))):
            if not sel.any():
                continue
            cuda_kw: dict[str, Any] = {"esize": size, "full": full}
            if full:
                table = np.stack(
                    [new_ptr[sel], old_ptr[sel], step[sel], first_row[:-1][sel]], axis=1
                )
                n_chunks = whole[sel]
                if cu is not None and stage_row0 is not None:
                    # Staging rows of this element size: its runs' whole chunks, in order
                    # (the count's block j writes row j; the encode finds a run's rows here).
                    srow = cu.stage_rows(whole[sel])
                    stage_row0[sel] = srow
                    staging[size] = cu.Staging.new(device, int(n_chunks.sum()), size)
                    cuda_kw["staging"] = staging[size]
            else:
                table = np.stack(
                    [
                        new_ptr[sel] + step[sel] * size,
                        old_ptr[sel] + step[sel] * size,
                        numel[sel] - step[sel],
                        first_row[:-1][sel] + whole[sel],
                    ],
                    axis=1,
                )
                n_chunks = chunks[sel] - whole[sel]
            _run_launch(
                _jit().count_runs_kernel,
                table,
                n_chunks,
                device,
                counts,
                wbits,
                num_warps=_COUNT_WARPS,
                cuda=("count_rows", {"staging": None, **cuda_kw}),
                DTYPE=_tl_dtype(size),
                FULL=full,
                CHUNK=CHUNK_ELEMENTS,
                TILE=_COUNT_TILE,
            )
    return CountedTable(
        new_ptr=new_ptr,
        numel=numel,
        esize=esize,
        first_row=first_row,
        counts=counts.cpu().numpy(),
        device_counts=counts,
        wbits=wbits,
        whole=whole,
        staging=staging,
        stage_row0=stage_row0,
        cuda=cu,
    )


def encode_table(
    counted: CountedTable,
    runs: np.ndarray,
    offsets_ptr: np.ndarray,
    index_ptr: np.ndarray,
    values_ptr: np.ndarray,
) -> None:
    """Encode runs `runs` (indices into `counted`'s table) of what `count_table` counted, each
    into its sparse chunk list at device addresses: offsets int64[chunks + 1], index
    int16[total], values[total] of its element size (the caller sized them from `totals`).
    One launch per element size, asynchronous."""
    runs = np.asarray(runs, dtype=np.int64)
    if runs.size == 0:
        return
    counts = counted.device_counts
    excl = torch.cumsum(counts, 0) - counts
    device = counts.device
    esize = counted.esize[runs]
    chunks = counted.first_row[runs + 1] - counted.first_row[runs]
    zeros = np.zeros(runs.size, dtype=np.int64)
    table = np.stack(
        [
            counted.new_ptr[runs],
            np.asarray(index_ptr, np.int64),
            np.asarray(values_ptr, np.int64),
            np.asarray(offsets_ptr, np.int64),
            counted.first_row[runs],
            counted.whole[runs],
            counted.stage_row0[runs] if counted.stage_row0 is not None else zeros,
            zeros,
        ],
        axis=1,
    )
    for size in np.unique(esize).tolist():
        sel = esize == size
        _run_launch(
            _jit().encode_runs_kernel,
            table[sel],
            chunks[sel],
            device,
            counts,
            excl,
            counted.wbits,
            num_warps=_ENCODE_WARPS,
            cuda=None
            if counted.cuda is None
            else ("encode_rows", {"esize": size, "staging": counted.staging.get(size)}),
            cuda_module=counted.cuda,
            DTYPE=_tl_dtype(size),
            CHUNK=CHUNK_ELEMENTS,
            BLOCK=_ENCODE_BLOCK,
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class CountedRuns:
    """What `count_runs` found: per run its change counts per chunk (on the host), and the
    device scratch `encode_runs` reads. Keep it until `encode_runs` returned."""

    news: list[torch.Tensor]
    """The runs' new bytes (flat integer views)."""
    first_row: list[int]
    """Row (global chunk index) of each run's first chunk."""
    counts: np.ndarray
    """Changed elements per row (int64)."""
    table: CountedTable | None = None
    """The device counts and bitmap (GPU, or triton's interpreter)."""

    def run_counts(self, i: int) -> np.ndarray:
        """Changed elements per chunk of run `i`."""
        r = self.first_row[i]
        return self.counts[r : r + num_chunks(self.news[i].numel())]

    @property
    def totals(self) -> list[int]:
        """Changed elements per run."""
        return [int(self.run_counts(i).sum()) for i in range(len(self.news))]


def count_runs(news: Sequence[torch.Tensor], olds: Sequence[torch.Tensor]) -> CountedRuns:
    """Count the changed elements of every chunk of every run (`news[i]` against `olds[i]`,
    flat integer views of equal size and dtype, on one device). On a GPU (or under triton's
    interpreter): `count_table` over the runs' addresses; on the CPU: `count_changes` per
    run."""
    if len(news) != len(olds):
        raise ConfigurationError("count_runs needs one old run per new run")
    for a, b in zip(news, olds, strict=True):
        _check_pair(a, b)
    sizes = [num_chunks(a.numel()) for a in news]
    first, rows = [], 0
    for c in sizes:
        first.append(rows)
        rows += c
    if not news or not _use_triton(news[0]):
        counts = torch.empty(rows, dtype=torch.int64)
        for i, (a, b) in enumerate(zip(news, olds, strict=True)):
            count_changes(a, b, counts[first[i] : first[i] + sizes[i]])
        return CountedRuns(news=list(news), first_row=first, counts=counts.numpy())
    table = count_table(
        news[0].device,
        np.array([a.data_ptr() for a in news], dtype=np.int64),
        np.array([b.data_ptr() for b in olds], dtype=np.int64),
        np.array([a.numel() for a in news], dtype=np.int64),
        np.array([a.element_size() for a in news], dtype=np.int64),
    )
    return CountedRuns(news=list(news), first_row=first, counts=table.counts, table=table)


def encode_runs(
    counted: CountedRuns,
    outputs: Sequence[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None],
    olds: Sequence[torch.Tensor] | None = None,
) -> None:
    """Encode the runs `count_runs` counted: for run i, ``outputs[k]`` = (i, offsets int64
    [chunks + 1], index int16 [total], values [total]) receives its sparse chunk list, or None
    to skip it. Asynchronous on a GPU (`encode_table`: one launch per element size). On the
    CPU `olds` (the runs `count_runs` compared with) are needed: the CPU path compares
    again."""
    jobs = [o for o in outputs if o is not None]
    if counted.table is None:
        if olds is None:
            raise ConfigurationError("encode_runs on the CPU needs the old runs")
        for i, offsets, index, values in jobs:
            offsets[0] = 0
            torch.cumsum(torch.from_numpy(counted.run_counts(i)), 0, out=offsets[1:])
            encode_changes(counted.news[i], olds[i], offsets, index, values)
        return
    for i, offsets, index, values in jobs:
        a = counted.news[i]
        chunks = num_chunks(a.numel())
        if offsets.numel() != chunks + 1 or index.numel() < int(counted.run_counts(i).sum()):
            raise ConfigurationError(f"encode_runs: outputs of run {i} do not fit its counts")
        if values.dtype != a.dtype or index.dtype != torch.int16 or offsets.dtype != torch.int64:
            raise ConfigurationError(f"encode_runs: outputs of run {i} have the wrong dtypes")
    encode_table(
        counted.table,
        np.array([i for i, _, _, _ in jobs], dtype=np.int64),
        np.array([o.data_ptr() for _, o, _, _ in jobs], dtype=np.int64),
        np.array([x.data_ptr() for _, _, x, _ in jobs], dtype=np.int64),
        np.array([v.data_ptr() for _, _, _, v in jobs], dtype=np.int64),
    )


def apply_runs(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
) -> None:
    """Apply many sparse chunk lists at once: per item (dst flat integer view, offsets int64
    [chunks + 1], index int16, values), as `apply_changes` does. On a GPU one launch per
    element size (asynchronous; the offsets are read on the device: the caller validated
    them); on the CPU `apply_changes` per item."""
    if not items:
        return
    if not _use_triton(items[0][0]):
        for dst, offsets, index, values in items:
            apply_changes(dst, offsets, index, values)
        return
    device = items[0][0].device
    by_size: dict[int, list[int]] = {}
    for k, (dst, offsets, index, values) in enumerate(items):
        if values.dtype != dst.dtype or offsets.numel() != num_chunks(dst.numel()) + 1:
            raise ConfigurationError("apply_runs: values or offsets do not match their run")
        if index.dtype != torch.int16 or offsets.dtype != torch.int64:
            raise ConfigurationError("apply_runs: index must be int16 and offsets int64")
        by_size.setdefault(dst.element_size(), []).append(k)
    for esize, members in sorted(by_size.items()):
        runs = []
        for k in members:
            dst, offsets, index, values = items[k]
            runs.append(
                (
                    dst.data_ptr(),
                    offsets.data_ptr(),
                    index.data_ptr(),
                    values.data_ptr(),
                    dst.numel(),
                    0,
                    0,
                    0,
                )
            )
        _run_launch(
            _jit().apply_runs_kernel,
            runs,
            [num_chunks(items[k][0].numel()) for k in members],
            device,
            num_warps=_APPLY_WARPS,
            cuda=("apply_rows", {"esize": esize}),
            DTYPE=_tl_dtype(esize),
            CHUNK=CHUNK_ELEMENTS,
            TILE=_APPLY_TILE,
        )
