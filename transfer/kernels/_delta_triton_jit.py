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

__all__ = [
    "apply_kernel",
    "apply_runs_kernel",
    "count_kernel",
    "count_runs_kernel",
    "encode_kernel",
    "encode_runs_kernel",
]


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
    # A constant loop bound, skipping with `if` (triton's interpreter cannot take a bound
    # loaded from memory under numpy >= 2.5).
    for j in range(0, CHUNK, TILE):
        if start + j < end:
            e = start + j + tl.arange(0, TILE)
            m = e < end
            idx = tl.load(index_ptr + e, mask=m, other=0).to(tl.int64) & 0xFFFF
            v = tl.load(values_ptr + e, mask=m, other=0)
            pos = c * CHUNK + idx
            tl.store(dst_ptr + pos, v, mask=m & (pos < n))


# -- table kernels: one launch over many runs (`weight_transfer.kernels.delta`'s tables) -------
# Program p handles chunk p of a launch's runs; it finds its run by binary search over the
# runs' first chunks (`first`, runs + 1 entries). Run tables are int64 words (device addresses).
# Loops have constant bounds and skip with `if` (triton's interpreter cannot take a loop bound
# loaded from memory under numpy >= 2.5).


@triton.jit
def _find_run(first_ptr, num_runs, pid, LOG: tl.constexpr):
    """The run r with first[r] <= pid < first[r + 1] (LOG >= log2(num_runs) steps)."""
    lo = pid * 0
    hi = lo + num_runs
    for _ in range(LOG):
        mid = (lo + hi) // 2
        go = tl.load(first_ptr + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _popc32(x):
    """Set bits of each uint32."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def count_runs_kernel(
    runs_ptr,
    first_ptr,
    num_runs,
    counts_ptr,
    wbits_ptr,
    DTYPE: tl.constexpr,
    FULL: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    LOG: tl.constexpr,
):
    """Run [new, old, numel, row0]: chunk `local` of the run is row g = row0 + local;
    counts[g] = its changed elements, wbits[g * CHUNK / 32 ...] its change bitmap in 32-bit
    words (bit b of word w: element 32 w + b changed). FULL: every chunk holds CHUNK elements at
    16-byte aligned addresses (no mask, vector loads); else one masked chunk per run."""
    pid = tl.program_id(0).to(tl.int64)
    run = _find_run(first_ptr, num_runs, pid, LOG)
    local = pid - tl.load(first_ptr + run)
    new = tl.load(runs_ptr + run * 4).to(tl.pointer_type(DTYPE)) + local * CHUNK
    old = tl.load(runs_ptr + run * 4 + 1).to(tl.pointer_type(DTYPE)) + local * CHUNK
    nelem = tl.load(runs_ptr + run * 4 + 2) - local * CHUNK
    g = tl.load(runs_ptr + run * 4 + 3) + local
    if FULL:
        new = tl.multiple_of(new, 16)
        old = tl.multiple_of(old, 16)
    W: tl.constexpr = CHUNK // 32
    shifts = tl.arange(0, 32).to(tl.uint32)
    acc = tl.zeros([TILE // 32], dtype=tl.int32)
    for i in range(0, CHUNK, TILE):
        lane = i + tl.arange(0, TILE)
        if FULL:
            ne = (tl.load(new + lane) != tl.load(old + lane)).to(tl.uint32)
        else:
            m = lane < nelem
            a = tl.load(new + lane, mask=m, other=0)
            b = tl.load(old + lane, mask=m, other=0)
            ne = ((a != b) & m).to(tl.uint32)
        ne2 = tl.reshape(ne, [TILE // 32, 32])
        acc += tl.sum(ne2, axis=1).to(tl.int32)
        words = tl.sum(ne2 << shifts[None, :], axis=1)
        tl.store(
            wbits_ptr + g * W + i // 32 + tl.arange(0, TILE // 32),
            words.to(tl.int32, bitcast=True),
        )
    tl.store(counts_ptr + g, tl.sum(acc, axis=0))


@triton.jit
def encode_runs_kernel(
    runs_ptr,
    first_ptr,
    num_runs,
    counts_ptr,
    excl_ptr,
    wbits_ptr,
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    LOG: tl.constexpr,
):
    """Run [new, index, values, offsets, row0, 0, 0, 0] (row0: the global row of its chunk 0):
    chunk `local` of the run writes offsets[local + 1] (offsets[0] = 0 by chunk 0) and its
    changed elements, in index order, at index/values[offsets[local] ...], from the bitmap
    words `count_runs_kernel` wrote (excl: exclusive prefix sum of all rows' counts). Work per
    block of words is its largest word's set bits, skipped when none is set; only the changed
    elements of `new` are read."""
    pid = tl.program_id(0).to(tl.int64)
    run = _find_run(first_ptr, num_runs, pid, LOG)
    local = pid - tl.load(first_ptr + run)
    r = runs_ptr + run * 8
    new = tl.load(r).to(tl.pointer_type(DTYPE)) + local * CHUNK
    index = tl.load(r + 1).to(tl.pointer_type(tl.int16))
    values = tl.load(r + 2).to(tl.pointer_type(DTYPE))
    offsets = tl.load(r + 3).to(tl.pointer_type(tl.int64))
    row0 = tl.load(r + 4)
    g = row0 + local
    start = tl.load(excl_ptr + g) - tl.load(excl_ptr + row0)
    tl.store(offsets + local + 1, start + tl.load(counts_ptr + g))
    tl.store(offsets, start * 0, mask=local == 0)
    W: tl.constexpr = CHUNK // 32
    one = tl.full([BLOCK], 1, tl.uint32)
    at = start
    for j in range(0, W, BLOCK):
        e = j + tl.arange(0, BLOCK)
        w = tl.load(wbits_ptr + g * W + e).to(tl.uint32, bitcast=True)
        pc = _popc32(w).to(tl.int32)
        total = tl.sum(pc, axis=0)
        if total > 0:
            pre = at + (tl.cumsum(pc, axis=0) - pc).to(tl.int64)
            most = tl.max(pc, axis=0)
            for t in range(0, 32):
                if t < most:
                    has = w != 0
                    # The lowest set bit's index: w ^ (w - 1) has that many + 1 low bits set.
                    below = w - one
                    lane = e.to(tl.int32) * 32 + _popc32(w ^ below).to(tl.int32) - 1
                    v = tl.load(new + lane, mask=has, other=0)
                    tl.store(index + pre + t, lane.to(tl.int16), mask=has)
                    tl.store(values + pre + t, v, mask=has)
                    w = w & below
        at += total


@triton.jit
def apply_runs_kernel(
    runs_ptr,
    first_ptr,
    num_runs,
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    LOG: tl.constexpr,
):
    """Run [dst, offsets, index, values, numel, 0, 0, 0]: chunk `local` of the run sets
    dst[local * CHUNK + index[j]] = values[j] for its entries j (offsets[local] ..
    offsets[local + 1]); an index past the run's end is dropped."""
    pid = tl.program_id(0).to(tl.int64)
    run = _find_run(first_ptr, num_runs, pid, LOG)
    local = pid - tl.load(first_ptr + run)
    r = runs_ptr + run * 8
    dst = tl.load(r).to(tl.pointer_type(DTYPE)) + local * CHUNK
    offsets = tl.load(r + 1).to(tl.pointer_type(tl.int64))
    index = tl.load(r + 2).to(tl.pointer_type(tl.int16))
    values = tl.load(r + 3).to(tl.pointer_type(DTYPE))
    nelem = tl.minimum(tl.load(r + 4) - local * CHUNK, CHUNK)
    start = tl.load(offsets + local)
    count = tl.load(offsets + local + 1) - start
    for j in range(0, CHUNK, TILE):
        if j < count:
            e = j + tl.arange(0, TILE)
            m = e < count
            idx = tl.load(index + start + e, mask=m, other=0).to(tl.int64) & 0xFFFF
            v = tl.load(values + start + e, mask=m, other=0)
            tl.store(dst + idx, v, mask=m & (idx < nelem))
