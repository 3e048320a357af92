"""Diff/encode and apply kernels of delta updates (torch ops on the CPU, Triton on a GPU).

What changed between the bytes last sent (the *snapshot*) and the new engine bytes of one
contiguous run of elements is encoded as a *sparse chunk list*: the run is cut into chunks of
`CHUNK_ELEMENTS` (65,536) elements; per chunk an int32 count of changed elements; then, chunk
after chunk, each changed element's 16-bit index inside its chunk and its new value (the
element's bytes: 1 for FP8, 2 for BF16, 4 for float32 scales). On the wire that is
``2 + value_bytes`` bytes per changed element plus 4 bytes per chunk; a run whose encoding would
not be smaller than the run itself is sent dense instead (the caller decides; `sparse_nbytes`).

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

import functools
import importlib
import math
from types import ModuleType
from typing import Any

import torch

from weight_transfer.errors import ConfigurationError, WeightTransferError
from weight_transfer.planner.delta import CHUNK_ELEMENTS, num_chunks, sparse_nbytes

__all__ = [
    "CHUNK_ELEMENTS",
    "ENCODINGS",
    "apply_changes",
    "count_changes",
    "diff_encode",
    "encode_changes",
    "encoded_nbytes",
    "int_view",
    "num_chunks",
    "sparse_nbytes",
]

_CPU_GROUP_CHUNKS = 64
"""Chunks the CPU path handles at once (bounds its temporaries to 4 Mi elements)."""

_TILE = 1024
"""Elements one Triton program step reads."""

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_JIT_MODULE = "weight_transfer.kernels._delta_triton_jit"

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
