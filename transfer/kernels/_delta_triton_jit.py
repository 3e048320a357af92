"""The Triton kernels behind `weight_transfer.kernels.delta` (imports triton on load).

One program per chunk of `CHUNK` elements, `TILE` elements per step. Tensors arrive as flat
integer views, so comparisons and copies are bitwise.
"""

# Triton reads a kernel's parameter annotations as its own type specs (tl.constexpr), so the
# runtime parameters stay unannotated and mypy is told so, for this module only.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["apply_kernel", "count_kernel", "encode_kernel"]


@triton.jit
def count_kernel(new_ptr, old_ptr, counts_ptr, n, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """counts[c] = number of i in chunk c with new[i] != old[i]."""
    c = tl.program_id(0).to(tl.int64)
    base = c * CHUNK
    acc = tl.zeros([TILE], dtype=tl.int32)
    for i in range(0, CHUNK, TILE):
        offs = base + i + tl.arange(0, TILE)
        m = offs < n
        a = tl.load(new_ptr + offs, mask=m, other=0)
        b = tl.load(old_ptr + offs, mask=m, other=0)
        acc += ((a != b) & m).to(tl.int32)
    tl.store(counts_ptr + c, tl.sum(acc, axis=0).to(tl.int64))


@triton.jit
def encode_kernel(
    new_ptr, old_ptr, offsets_ptr, index_ptr, values_ptr, n, CHUNK: tl.constexpr, TILE: tl.constexpr
):
    """Chunk c's changed elements, in index order, at offsets[c]: 16-bit index and value."""
    c = tl.program_id(0).to(tl.int64)
    base = c * CHUNK
    out = tl.load(offsets_ptr + c)
    for i in range(0, CHUNK, TILE):
        lane = i + tl.arange(0, TILE)
        offs = base + lane
        m = offs < n
        a = tl.load(new_ptr + offs, mask=m, other=0)
        b = tl.load(old_ptr + offs, mask=m, other=0)
        ne = ((a != b) & m).to(tl.int32)
        pos = out + tl.cumsum(ne, axis=0) - ne
        keep = ne != 0
        tl.store(index_ptr + pos, lane.to(tl.int16), mask=keep)
        tl.store(values_ptr + pos, a, mask=keep)
        out += tl.sum(ne, axis=0)


@triton.jit
def apply_kernel(
    dst_ptr, offsets_ptr, index_ptr, values_ptr, n, CHUNK: tl.constexpr, TILE: tl.constexpr
):
    """dst[c * CHUNK + index[j]] = values[j] for the entries j of chunk c."""
    c = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + c)
    end = tl.load(offsets_ptr + c + 1)
    for j in range(start, end, TILE):
        e = j + tl.arange(0, TILE)
        m = e < end
        idx = tl.load(index_ptr + e, mask=m, other=0).to(tl.int64) & 0xFFFF
        v = tl.load(values_ptr + e, mask=m, other=0)
        pos = c * CHUNK + idx
        tl.store(dst_ptr + pos, v, mask=m & (pos < n))
