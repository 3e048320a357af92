"""Many device copies as one or two kernel launches over a table of (source, destination) chunks.

The loopback backend's CUDA IPC writes used to be one `cudaMemcpyAsync` per write, issued from
Python: about 40 us of host time each, which on one GPU (where the copy itself runs at the
memory's rate) was the whole update. Here a batch of copies is

1. coalesced: copies sorted by destination, and a copy that continues both the previous one's
   source and destination is merged into it (adjacent slices of one tensor into adjacent bytes
   of a fused engine tensor become one copy);
2. cut into a chunk table: every copy whose addresses are 16-byte aligned gives full
   `CHUNK_BYTES` chunks (one table row each: source address, destination address) and at most
   one tail shorter than a chunk (a row with its length); copies that are not aligned stay plain
   `cudaMemcpyAsync` calls;
3. run as one launch of `_copy_chunks` (unmasked, 8-byte words) over the chunk rows and one of
   `_copy_tails` (masked) over the tails.

The table lives on the device. A batch that repeats every update (`Transport.prepare_writes`)
builds it once, so posting it costs two launches and no per-write Python at all.

The pure parts (coalescing, the table) are plain Python and CPU torch, tested on the CPU; the
kernels run on the CPU too under triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

CHUNK_BYTES = 64 << 10
"""Bytes one program of `_copy_chunks` copies."""
BLOCK_WORDS = 8192
"""8-byte words one loop step of a program moves (a whole 64 KiB chunk: one load, one store)."""
NUM_WARPS = 16
"""Warps per program. Chunk, block and warps were picked by
benchmarks/probes/gpu_table_copy_probe.py on an H200 (1.04x torch's copy_ on 8 GiB contiguous
and on 2,674 copies of 3 MiB; the first guess, 1024 words and 4 warps, was 1.10x-1.13x)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Tuning:
    """How the kernels cut and run a table: the three constants above, or other values (the
    loopback backend's `copy_chunk_bytes`, `copy_block_words`, `copy_num_warps` options)."""

    chunk_bytes: int = CHUNK_BYTES
    """Bytes one program copies (a power of two, at least 16)."""
    block_words: int = BLOCK_WORDS
    """8-byte words one loop step moves (a power of two)."""
    num_warps: int = NUM_WARPS
    """Warps per program (a power of two)."""

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "block_words", "num_warps"):
            value = getattr(self, name)
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name} must be a positive power of two, got {value}")
        if self.chunk_bytes < 16:
            raise ValueError(f"chunk_bytes must be at least 16, got {self.chunk_bytes}")


ALIGN = 16
"""Copies whose source, destination and length are multiples of this use the kernels."""

_JIT_MODULE = "weight_transfer.kernels._table_copy_jit"


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    """One device copy: `nbytes` from address `src` to address `dst`."""

    dst: int
    src: int
    nbytes: int


def coalesce(copies: Sequence[Copy]) -> list[Copy]:
    """The copies sorted by destination, each run that is contiguous in both source and
    destination merged into one copy. The bytes written are the same."""
    out: list[Copy] = []
    for c in sorted(copies, key=lambda c: c.dst):
        if out:
            last = out[-1]
            if last.dst + last.nbytes == c.dst and last.src + last.nbytes == c.src:
                out[-1] = Copy(last.dst, last.src, last.nbytes + c.nbytes)
                continue
        out.append(c)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkTable:
    """A batch of copies cut for the kernels (CPU int64 tensors), plus what the kernels cannot
    take."""

    chunks: torch.Tensor
    """Shape (n, 2): source and destination address of each full `CHUNK_BYTES` chunk."""
    tails: torch.Tensor
    """Shape (m, 3): source, destination and length (< CHUNK_BYTES, multiple of 8)."""
    plain: tuple[Copy, ...]
    """Copies with an address or length that is not a multiple of `ALIGN`."""
    nbytes: int
    """Every byte of the batch."""


def chunk_table(copies: Sequence[Copy], chunk_bytes: int | None = None) -> ChunkTable:
    """Cut coalesced copies into full chunks and tails; unaligned copies go to `plain`."""
    aligned = [c for c in copies if not (c.dst % ALIGN or c.src % ALIGN or c.nbytes % ALIGN)]
    plain = tuple(c for c in copies if c.dst % ALIGN or c.src % ALIGN or c.nbytes % ALIGN)
    table = chunk_arrays(
        np.array([c.dst for c in aligned], dtype=np.int64),
        np.array([c.src for c in aligned], dtype=np.int64),
        np.array([c.nbytes for c in aligned], dtype=np.int64),
        chunk_bytes,
    )
    total = table.nbytes + sum(c.nbytes for c in plain)
    return ChunkTable(table.chunks, table.tails, plain, total)


def chunk_arrays(
    dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, chunk_bytes: int | None = None
) -> ChunkTable:
    """`chunk_table` of copies given as address columns, all aligned to `ALIGN` (numpy over
    the columns, nothing per copy; no coalescing)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    dst, src, n = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (dst, src, nbytes))
    full = n // chunk_bytes
    copy_of = np.repeat(np.arange(n.size, dtype=np.int64), full)
    first = np.cumsum(full) - full  # index of each copy's first chunk row
    within = np.arange(int(full.sum()), dtype=np.int64) - np.repeat(first, full)
    chunks = np.stack(
        [src[copy_of] + within * chunk_bytes, dst[copy_of] + within * chunk_bytes], axis=1
    )
    rest = n - full * chunk_bytes
    has = rest > 0
    tails = np.stack(
        [src[has] + full[has] * chunk_bytes, dst[has] + full[has] * chunk_bytes, rest[has]], axis=1
    )
    return ChunkTable(
        torch.from_numpy(chunks.reshape(-1, 2)),
        torch.from_numpy(tails.reshape(-1, 3)),
        (),
        int(n.sum()),
    )


@functools.cache
def jit() -> ModuleType | None:
    """The Triton kernels, or None where triton cannot be imported."""
    try:
        return importlib.import_module(_JIT_MODULE)
    except ImportError:
        return None


@dataclasses.dataclass(slots=True)
class DeviceTable:
    """A `ChunkTable` whose rows live on a device, ready to launch any number of times."""

    chunks: torch.Tensor
    tails: torch.Tensor
    plain: tuple[Copy, ...]
    nbytes: int
    num_copies: int
    """Copies after coalescing (the launches replace this many memcpy calls)."""


def to_device(table: ChunkTable, device: torch.device, num_copies: int) -> DeviceTable:
    """Upload the table's rows (synchronously; done once per prepared batch)."""
    return DeviceTable(
        table.chunks.contiguous().to(device),
        table.tails.contiguous().to(device),
        table.plain,
        table.nbytes,
        num_copies,
    )


def launch(
    table: DeviceTable,
    chunk_bytes: int | None = None,
    block_words: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Run the table's copies on the current stream of the table's device (no plain copies:
    the caller issues `table.plain` itself). The table must have been cut with `chunk_bytes`."""
    mod = jit()
    assert mod is not None, "launch() without triton; check jit() first"
    mod.run(
        table.chunks,
        table.tails,
        chunk_bytes or CHUNK_BYTES,
        block_words or BLOCK_WORDS,
        num_warps or NUM_WARPS,
    )


def available() -> bool:
    """Whether the kernels can run here (triton imports)."""
    return jit() is not None


def describe(table: DeviceTable | ChunkTable) -> dict[str, Any]:
    """Counts for logs and benchmarks."""
    return {
        "chunks": int(table.chunks.shape[0]),
        "tails": int(table.tails.shape[0]),
        "plain": len(table.plain),
        "nbytes": table.nbytes,
    }
