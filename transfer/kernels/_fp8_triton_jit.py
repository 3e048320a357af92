"""The Triton JIT kernels behind `weight_transfer.kernels.fp8_triton` (imports triton on load).

Kept in its own module so that importing `weight_transfer.kernels.fp8_triton` never imports triton.
`@triton.jit` decides at decoration time whether it builds a compiled kernel or an interpreted
one (triton reads its own TRITON_INTERPRET switch), so this module is imported once, lazily.
"""

# Triton reads a kernel's parameter annotations as its own type specs (tl.constexpr, "i32"),
# so the runtime parameters stay unannotated and mypy is told so, for this module only.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_block_quant_kernel", "fp8_table_quant2_kernel", "fp8_table_quant_kernel"]


@triton.jit
def _e4m3_bits(y, SOFTWARE_CVT: tl.constexpr):
    """float32 `y` (already clamped to +-448) as float8_e4m3fn bit patterns (uint8)."""
    if SOFTWARE_CVT:
        # float32 -> float8_e4m3fn, round to nearest even, done with integer ops. Used by the
        # CPU interpreter, whose own fp8 cast does not round to nearest even. |y| <= 448 here.
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # Normal e4m3 (|y| >= 2**-6): drop 20 mantissa bits with RNE, rebias exponent 127 -> 7.
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        # Subnormal e4m3 (|y| < 2**-6): count steps of 2**-9; adding 2**23 rounds the
        # (exact) product to an integer with RNE and leaves that integer in the low bits.
        steps = tl.abs(y) * 512.0 + 8388608.0
        subnormal = steps.to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(mag >= 0x3C800000, normal, subnormal)
        code = tl.where(mag > 0x7F800000, 0x7F, code)
        q = (code | sign).to(tl.uint8)
    else:
        # Hardware cvt.rn.satfinite (sm_89+): round to nearest even, like torch's cast.
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return q


@triton.jit
def fp8_block_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    num_row_blocks,
    num_col_blocks,
    x_stride_l,
    x_stride_r,
    x_stride_c,
    q_stride_l,
    q_stride_r,
    q_stride_c,
    s_stride_l,
    s_stride_r,
    s_stride_c,
    amax_floor,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SOFTWARE_CVT: tl.constexpr,
):
    """One program quantizes one (BLOCK_R x BLOCK_C) block of one matrix of the stack.

    `q_ptr` points at the fp8 output viewed as uint8. TILE_* are BLOCK_* rounded up to powers
    of two (tl.arange needs them); the extra lanes are masked off like the matrix's edge.
    """
    # int64 from the start: an expert stack can hold more than 2**31 elements.
    pid = tl.program_id(0).to(tl.int64)
    blocks_per_matrix = num_row_blocks * num_col_blocks
    lead = pid // blocks_per_matrix
    in_matrix = pid % blocks_per_matrix
    row_block = in_matrix // num_col_blocks
    col_block = in_matrix % num_col_blocks

    tile_r = tl.arange(0, TILE_R)
    tile_c = tl.arange(0, TILE_C)
    r = row_block * BLOCK_R + tile_r
    c = col_block * BLOCK_C + tile_c
    mask = ((r < rows) & (tile_r < BLOCK_R))[:, None] & ((c < cols) & (tile_c < BLOCK_C))[None, :]

    x_offsets = lead * x_stride_l + r[:, None] * x_stride_r + c[None, :] * x_stride_c
    # Masked lanes read 0: |0| never raises the amax, so edge blocks see only their own values.
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)

    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    # tl.max ignores NaN; torch.amax (the reference) propagates it to the block's scale.
    num_nan = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
    amax = tl.maximum(amax, amax_floor)
    amax = tl.where(num_nan > 0, float("nan"), amax)
    # IEEE round-to-nearest division, as torch does on CPU (`/` in Triton is approximate).
    scale = tl.math.div_rn(amax, FP8_MAX)
    y = tl.math.div_rn(x, scale)
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)

    q = _e4m3_bits(y, SOFTWARE_CVT)

    q_offsets = lead * q_stride_l + r[:, None] * q_stride_r + c[None, :] * q_stride_c
    tl.store(q_ptr + q_offsets, q, mask=mask)
    tl.store(s_ptr + lead * s_stride_l + row_block * s_stride_r + col_block * s_stride_c, scale)


@triton.jit
def _table_unit(units_ptr, block_unit_ptr, X_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's matrix and block, read from a `QuantTable` (layout in
    `fp8_table_quant_kernel`): pointers, sizes, block coordinates and row strides."""
    pid = tl.program_id(0).to(tl.int64)
    unit = tl.load(block_unit_ptr + pid).to(tl.int64)
    u = units_ptr + unit * 16
    x_ptr = tl.load(u).to(tl.pointer_type(X_DTYPE))
    q_ptr = tl.load(u + 1).to(tl.pointer_type(tl.uint8))
    s_ptr = tl.load(u + 2).to(tl.pointer_type(tl.float32))
    rows = tl.load(u + 3)
    cols = tl.load(u + 4)
    num_col_blocks = tl.load(u + 5)
    in_matrix = pid - tl.load(u + 6)
    x_stride_r = tl.load(u + 7)
    q_stride_r = tl.load(u + 8)
    s_stride_r = tl.load(u + 9)
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        q_ptr = tl.multiple_of(q_ptr, 16)
        x_stride_r = tl.multiple_of(x_stride_r, 16)
        q_stride_r = tl.multiple_of(q_stride_r, 16)
        cols = tl.multiple_of(cols, 16)
    row_block = in_matrix // num_col_blocks
    col_block = in_matrix % num_col_blocks
    return x_ptr, q_ptr, s_ptr, rows, cols, row_block, col_block, x_stride_r, q_stride_r, s_stride_r


@triton.jit
def fp8_table_quant_kernel(
    units_ptr,
    block_unit_ptr,
    amax_floor,
    X_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SOFTWARE_CVT: tl.constexpr,
):
    """One program quantizes one block of one of many matrices, read from a table.

    `units_ptr` holds one row of `UNIT_FIELDS` int64 per matrix: input, fp8 output (uint8)
    and scale addresses, rows, cols, column blocks, the unit's first program, then the row
    strides of input, output and scales (elements; the last dims are contiguous).
    `block_unit_ptr[pid]` (int32) is the unit of program `pid`. Same arithmetic as
    `fp8_block_quant_kernel`, bit for bit; the amax is one integer max over |x|'s bits, which
    orders non-negative floats as floats do and puts NaN above inf (so NaN needs no second
    reduction). ALIGNED: every address is 16-byte aligned and every row stride and column
    count a multiple of 16 elements, so loads and stores are vectorized.
    """
    x_ptr, q_ptr, s_ptr, rows, cols, row_block, col_block, x_stride_r, q_stride_r, s_stride_r = (
        _table_unit(units_ptr, block_unit_ptr, X_DTYPE, ALIGNED)
    )

    tile_r = tl.arange(0, TILE_R)
    tile_c = tl.arange(0, TILE_C)
    r = row_block * BLOCK_R + tile_r
    c = col_block * BLOCK_C + tile_c
    mask = ((r < rows) & (tile_r < BLOCK_R))[:, None] & ((c < cols) & (tile_c < BLOCK_C))[None, :]

    x = tl.load(x_ptr + (r[:, None] * x_stride_r + c[None, :]), mask=mask, other=0.0)
    x = x.to(tl.float32)
    mag_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    top = tl.max(tl.max(mag_bits, axis=1), axis=0)
    amax = tl.maximum(top.to(tl.float32, bitcast=True), amax_floor)
    amax = tl.where(top > 0x7F800000, float("nan"), amax)
    scale = tl.math.div_rn(amax, FP8_MAX)
    y = tl.math.div_rn(x, scale)
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)

    q = _e4m3_bits(y, SOFTWARE_CVT)

    tl.store(q_ptr + (r[:, None] * q_stride_r + c[None, :]), q, mask=mask)
    tl.store(s_ptr + row_block * s_stride_r + col_block, scale)


@triton.jit
def fp8_table_quant2_kernel(
    units_ptr,
    block_unit_ptr,
    amax_floor,
    X_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SOFTWARE_CVT: tl.constexpr,
    SUB_R: tl.constexpr,
):
    """`fp8_table_quant_kernel` in two passes over SUB_R-row slices of the block: the first
    finds the amax, the second re-reads each slice (from L2) and quantizes it. Fewer registers
    per thread than holding the whole block, so more programs per SM keep loads in flight.
    TILE_R must be a multiple of SUB_R."""
    x_ptr, q_ptr, s_ptr, rows, cols, row_block, col_block, x_stride_r, q_stride_r, s_stride_r = (
        _table_unit(units_ptr, block_unit_ptr, X_DTYPE, ALIGNED)
    )

    tile_r = tl.arange(0, SUB_R)
    tile_c = tl.arange(0, TILE_C)
    c = col_block * BLOCK_C + tile_c
    c_mask = ((c < cols) & (tile_c < BLOCK_C))[None, :]
    top = tl.zeros([SUB_R, TILE_C], dtype=tl.int32)
    for r0 in range(0, TILE_R, SUB_R):
        r = row_block * BLOCK_R + r0 + tile_r
        mask = ((r < rows) & (r0 + tile_r < BLOCK_R))[:, None] & c_mask
        x = tl.load(x_ptr + (r[:, None] * x_stride_r + c[None, :]), mask=mask, other=0.0)
        top = tl.maximum(top, x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    top_all = tl.max(tl.max(top, axis=1), axis=0)
    amax = tl.maximum(top_all.to(tl.float32, bitcast=True), amax_floor)
    amax = tl.where(top_all > 0x7F800000, float("nan"), amax)
    scale = tl.math.div_rn(amax, FP8_MAX)
    for r0 in range(0, TILE_R, SUB_R):
        r = row_block * BLOCK_R + r0 + tile_r
        mask = ((r < rows) & (r0 + tile_r < BLOCK_R))[:, None] & c_mask
        x = tl.load(x_ptr + (r[:, None] * x_stride_r + c[None, :]), mask=mask, other=0.0)
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        q = _e4m3_bits(y, SOFTWARE_CVT)
        tl.store(q_ptr + (r[:, None] * q_stride_r + c[None, :]), q, mask=mask)
    tl.store(s_ptr + row_block * s_stride_r + col_block, scale)
