"""FP8 e4m3 block quantization on the GPU in one pass, bit-identical to `planner.fp8`.

`quantize_fp8_blockwise_gpu` runs a Triton kernel that reads each block of `x` once and writes
both the float8_e4m3fn weight and its float32 `weight_scale_inv` entry. It reproduces
`planner.fp8.quantize_fp8_blockwise` as computed on the CPU bit for bit: amax in float32,
clamped below at `AMAX_FLOOR`, scale = amax / 448 and q = e4m3(clamp(x / scale, -448, 448)),
both divisions IEEE round-to-nearest, the cast round-to-nearest-even. Partial edge blocks use
only their own elements; leading dimensions (experts) are independent matrices.

Inputs may be any strided view (a slice of a larger tensor); outputs may be caller-provided
views too (a slice of registered staging memory), on the input's GPU or in pinned host memory.
The kernel runs on the current CUDA stream of `x`'s device and does not synchronize.

`quantize_fp8` is the dispatcher: CUDA tensors go to the kernel, CPU tensors to the reference.

Importing this module never imports triton; calling the kernel without triton raises
`WeightTransferError` saying what to install.

Note on the reference: `planner.fp8` computes `amax / 448.0` with a Python scalar divisor;
PyTorch's CUDA kernel turns that into `amax * float32(1 / 448)`, which differs from the IEEE
quotient in about half of all cases, so the reference evaluated *on a CUDA tensor* is not
bit-identical to itself on the CPU. This kernel follows the documented (CPU, IEEE) semantics.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any

import torch

from weight_transfer.errors import ConfigurationError, WeightTransferError
from weight_transfer.planner.fp8 import AMAX_FLOOR, FP8_MAX, quantize_fp8_blockwise, scale_shape

__all__ = [
    "SUPPORTED_INPUT_DTYPES",
    "QuantTable",
    "quantize_fp8",
    "quantize_fp8_blockwise_gpu",
    "triton_available",
]

logger = logging.getLogger(__name__)

SUPPORTED_INPUT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
)
"""Input dtypes the kernel reads (each is converted to float32 exactly as `Tensor.to` does)."""

_MAX_TILE_ELEMENTS = 128 * 256
"""Largest power-of-two-padded block one program holds in registers."""

_JIT_MODULE = "weight_transfer.kernels._fp8_triton_jit"


def triton_available() -> bool:
    """Whether triton can be imported here (says nothing about a GPU being present)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


@functools.cache
def _jit_module() -> ModuleType:
    try:
        return importlib.import_module(_JIT_MODULE)
    except ImportError as exc:
        raise WeightTransferError(
            "the GPU FP8 quantizer needs triton, which could not be imported "
            f"({exc}); install it with `pip install triton` (it ships with CUDA builds of torch)"
        ) from exc


def _is_interpreted(kernel: Any) -> bool:
    # triton's CPU interpreter (TRITON_INTERPRET=1 when the kernel module was imported) runs
    # on CPU tensors; a compiled kernel needs device memory.
    return type(kernel).__name__ == "InterpretedFunction"


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(block, tuple | list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigurationError(f"block must be two positive ints, got {block!r}")
    b0, b1 = int(block[0]), int(block[1])
    if _next_pow2(b0) * _next_pow2(b1) > _MAX_TILE_ELEMENTS:
        raise ConfigurationError(
            f"block {block} is too large for the GPU quantizer: its power-of-two padding "
            f"holds more than {_MAX_TILE_ELEMENTS} elements"
        )
    return b0, b1


def _check_out(
    out: torch.Tensor,
    *,
    what: str,
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    device: torch.device,
) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what} for {name!r} must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise ConfigurationError(f"{what} for {name!r} has dtype {out.dtype}, expected {dtype}")
    if tuple(out.shape) != shape:
        raise ConfigurationError(
            f"{what} for {name!r} has shape {tuple(out.shape)}, expected {shape}"
        )
    if any(st == 0 and size > 1 for st, size in zip(out.stride(), out.shape, strict=True)):
        raise ConfigurationError(
            f"{what} for {name!r} has a zero stride (a broadcast view); elements would alias"
        )
    if out.device != device and not (device.type == "cuda" and out.is_pinned()):
        raise ConfigurationError(
            f"{what} for {name!r} is on {out.device}; it must be on {device}"
            + (" or in pinned host memory" if device.type == "cuda" else "")
        )


def _check_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name!r} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ConfigurationError(
            f"FP8 block quantization of {name!r} needs at least 2 dims, got shape {tuple(x.shape)}"
        )
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ConfigurationError(
            f"{name!r} has dtype {x.dtype}; FP8 block quantization reads "
            f"{', '.join(str(d) for d in SUPPORTED_INPUT_DTYPES)}"
        )


def _collapse_leading(t: torch.Tensor) -> tuple[int, int] | None:
    """(count, stride) of `t`'s leading dims as one strided dim, or None if they do not fold."""
    sizes = [s for s in t.shape[:-2]]
    strides = [st for st in t.stride()[:-2]]
    count, stride = 1, 0
    for size, st in reversed(list(zip(sizes, strides, strict=True))):
        if size == 1:
            continue
        if count == 1:
            count, stride = size, st
        elif st == stride * count:
            count *= size
        else:
            return None
    return count, stride


def _launch(
    kernel: Any,
    x: torch.Tensor,
    q_bytes: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    num_warps: int,
    software_cvt: bool,
) -> None:
    """Launch over every block of `x` (>= 2 dims); recurse on leading dims that do not fold.

    `software_cvt` selects the integer fp8 cast instead of the hardware one (the interpreter
    needs it; on a GPU both give the same bits: benchmarks/probes/gpu_fp8_kernel_check.py checks
    that).
    """
    folded = [_collapse_leading(t) for t in (x, q_bytes, scale)]
    if any(f is None for f in folded) or len({f[0] for f in folded if f is not None}) != 1:
        for i in range(x.shape[0]):
            _launch(kernel, x[i], q_bytes[i], scale[i], block, num_warps, software_cvt)
        return
    (num_mats, xs_l), (_, qs_l), (_, ss_l) = folded  # type: ignore[misc]
    rows, cols = x.shape[-2], x.shape[-1]
    num_row_blocks, num_col_blocks = scale.shape[-2], scale.shape[-1]
    num_programs = num_mats * num_row_blocks * num_col_blocks
    if num_programs == 0:
        return
    b0, b1 = block
    kernel[(num_programs,)](
        x,
        q_bytes,
        scale,
        rows,
        cols,
        num_row_blocks,
        num_col_blocks,
        xs_l,
        x.stride(-2),
        x.stride(-1),
        qs_l,
        q_bytes.stride(-2),
        q_bytes.stride(-1),
        ss_l,
        scale.stride(-2),
        scale.stride(-1),
        AMAX_FLOOR,
        BLOCK_R=b0,
        BLOCK_C=b1,
        TILE_R=_next_pow2(b0),
        TILE_C=_next_pow2(b1),
        FP8_MAX=FP8_MAX,
        SOFTWARE_CVT=software_cvt,
        num_warps=num_warps,
    )


def quantize_fp8_blockwise_gpu(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_q: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    *,
    name: str = "x",
    num_warps: int = 8,
    software_cast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a CUDA tensor per block of its last two dims, in one pass.

    Asynchronous on the current stream of `x`'s device, like any CUDA op. Not thread-safe with
    respect to concurrent writers of the outputs; the caller owns every tensor.

    Args:
        x: float32/bfloat16/float16/float64 tensor with >= 2 dims on a CUDA device; any strides
            (a view into a larger tensor is read in place, nothing is copied).
        block: (rows, cols) of one quantization block.
        out_q: optional float8_e4m3fn tensor of x's shape (any strides) to write the weight
            into, on x's device or in pinned host memory.
        out_scale: optional float32 tensor of `scale_shape(x.shape, block)` (any strides) for
            the dequantization scales, same placement rules.
        name: what to call `x` in error messages (e.g. the parameter's name).
        num_warps: warps per program (a tuning knob; results do not depend on it).
        software_cast: do the float32 -> e4m3 cast with integer ops instead of the hardware
            instruction (same bits; a diagnostic). None: hardware on a GPU, software in
            triton's CPU interpreter, whose own cast does not round to nearest even.

    Returns:
        (weight, weight_scale_inv): `out_q`/`out_scale` when given, else new tensors.

    Raises:
        TypeError, ConfigurationError: bad arguments, before anything is written.
        WeightTransferError: triton cannot be imported.
    """
    _check_input(x, name)
    block = _check_block(block)
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ConfigurationError(f"num_warps must be a power of two <= 32, got {num_warps}")
    shape = tuple(x.shape)
    s_shape = scale_shape(shape, block)
    if out_q is not None:
        _check_out(
            out_q, what="out_q", name=name, dtype=torch.float8_e4m3fn, shape=shape, device=x.device
        )
    if out_scale is not None:
        _check_out(
            out_scale,
            what="out_scale",
            name=name,
            dtype=torch.float32,
            shape=s_shape,
            device=x.device,
        )
    if not x.is_cuda and not (
        x.device.type == "cpu"
        and triton_available()
        and _is_interpreted(_jit_module().fp8_block_quant_kernel)
    ):
        raise ConfigurationError(
            f"the GPU FP8 quantizer needs {name!r} on a CUDA device, got {x.device}; use "
            "quantize_fp8 (which falls back to the reference on the CPU)"
        )
    kernel = _jit_module().fp8_block_quant_kernel
    q = (
        out_q
        if out_q is not None
        else torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    )
    scale = (
        out_scale
        if out_scale is not None
        else torch.empty(s_shape, dtype=torch.float32, device=x.device)
    )
    software = (not x.is_cuda) if software_cast is None else software_cast
    if x.is_cuda:
        with torch.cuda.device(x.device):
            _launch(kernel, x, q.view(torch.uint8), scale, block, num_warps, software)
    else:
        _launch(kernel, x, q.view(torch.uint8), scale, block, num_warps, software)
    return q, scale


def quantize_fp8(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_q: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    *,
    name: str = "x",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` per block: Triton kernel for CUDA tensors, `planner.fp8` reference otherwise.

    Both paths give the same bits (the CPU reference's). With `out_q`/`out_scale` the result is
    written into them (after every argument has been checked) and they are returned.

    Raises:
        TypeError, ConfigurationError: bad arguments, before anything is written.
        WeightTransferError: `x` is on a CUDA device and triton cannot be imported.
    """
    if isinstance(x, torch.Tensor) and x.is_cuda:
        return quantize_fp8_blockwise_gpu(x, block, out_q, out_scale, name=name)
    _check_input(x, name)
    block = _check_block(block)
    shape = tuple(x.shape)
    if out_q is not None:
        _check_out(
            out_q, what="out_q", name=name, dtype=torch.float8_e4m3fn, shape=shape, device=x.device
        )
    if out_scale is not None:
        _check_out(
            out_scale,
            what="out_scale",
            name=name,
            dtype=torch.float32,
            shape=scale_shape(shape, block),
            device=x.device,
        )
    q, scale = quantize_fp8_blockwise(x, block)
    if out_q is not None:
        out_q.copy_(q)
        q = out_q
    if out_scale is not None:
        out_scale.copy_(scale)
        scale = out_scale
    return q, scale


_UNIT_FIELDS = 16
"""int64 fields per matrix in a `QuantTable`'s unit table (10 used, padded to 128 bytes)."""

_TRITON_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Input dtypes the table kernel reads (float64 inputs take the per-call kernel)."""


class QuantTable:
    """Many FP8 block quantizations as one kernel launch over a table on the device.

    A MoE layer's experts are hundreds of small matrices: one `quantize_fp8_blockwise_gpu`
    launch each (a fraction of a wave on a large GPU, plus a launch gap) leaves the GPU mostly
    idle. A table lists every matrix once (addresses, sizes, row strides) and maps each program
    to its matrix, so a whole group is one launch that fills the GPU. The results are those of
    `quantize_fp8_blockwise_gpu`, bit for bit (tested through triton's interpreter, and on an
    H200 by `benchmarks/probes/gpu_fp8_kernel_check.py`).

    The table holds raw addresses: the caller keeps every tensor alive and in place while the
    table is used (the pipeline's graph groups do). `launch` runs on the current stream.
    """

    def __init__(
        self,
        calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        block: tuple[int, int],
        *,
        num_warps: int = 8,
        software_cast: bool | None = None,
        sub_rows: int = 32,
        num_stages: int | None = None,
    ) -> None:
        """Check and tabulate `calls`: (x, out_q, out_scale) triples, each as
        `quantize_fp8_blockwise_gpu(x, block, out_q, out_scale)` would take them.

        `sub_rows` > 0 runs the two-pass kernel over slices of that many rows (a power of two
        dividing the block's padded rows); 0 holds the whole block in registers. The defaults
        (8 warps, 32-row slices) were the fastest of 15 variants on an H200
        (`benchmarks/results/update_h200_202612.json`, key `probes.quant_table_call8`: 1.30x /
        1.21x the copy-rate bound for Llama-8B's matrices / Qwen3 experts, against 1.78x /
        1.69x for the one-pass kernel and 1.83x / 4.11x for per-matrix launches replayed from a
        CUDA graph).

        Raises:
            ConfigurationError: a call the table kernel cannot take (see `why_not`); nothing is
                launched.
        """
        block = _check_block(block)
        sub_rows = min(sub_rows, _next_pow2(block[0]))
        if sub_rows and (sub_rows & (sub_rows - 1) or _next_pow2(block[0]) % sub_rows):
            raise ConfigurationError(
                f"sub_rows {sub_rows} must be a power of two dividing {_next_pow2(block[0])}"
            )
        self._sub_rows = sub_rows
        self._num_stages = num_stages
        if not calls:
            raise ConfigurationError("a QuantTable needs at least one call")
        dtype, device = calls[0][0].dtype, calls[0][0].device
        units: list[list[int]] = []
        counts: list[int] = []
        aligned = True
        for i, (x, q, s) in enumerate(calls):
            why = self.why_not(x, q, s, block)
            if why is None and (x.dtype != dtype or x.device != device):
                why = f"dtype/device {x.dtype}/{x.device} differs from the first call's"
            if why is not None:
                raise ConfigurationError(f"QuantTable call {i}: {why}")
            rows, cols = x.shape
            nrb, ncb = s.shape
            isz = x.element_size()
            aligned &= (
                x.data_ptr() % 16 == 0
                and q.data_ptr() % 16 == 0
                and x.stride(0) % 16 == 0
                and q.stride(0) % 16 == 0
                and cols % 16 == 0
                and block[1] % 16 == 0
                and isz in (2, 4)
            )
            units.append(
                [
                    x.data_ptr(),
                    q.data_ptr(),
                    s.data_ptr(),
                    rows,
                    cols,
                    ncb,
                    sum(counts),
                    x.stride(0),
                    q.stride(0),
                    s.stride(0),
                ]
                + [0] * (_UNIT_FIELDS - 10)
            )
            counts.append(nrb * ncb)
        self.block = block
        self.num_programs = sum(counts)
        self.num_units = len(units)
        self._dtype = dtype
        self._aligned = aligned
        self._num_warps = num_warps
        self._software = (not calls[0][0].is_cuda) if software_cast is None else software_cast
        unit_table = torch.tensor(units, dtype=torch.int64)
        block_unit = torch.repeat_interleave(
            torch.arange(len(units), dtype=torch.int32), torch.tensor(counts, dtype=torch.int64)
        )
        self.units = unit_table.to(device)
        self.block_unit = block_unit.to(device)
        self.device = device

    @staticmethod
    def why_not(
        x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]
    ) -> str | None:
        """Why the table kernel cannot take this call (None when it can): it takes 2-D inputs
        of float32/bfloat16/float16 whose last dims are contiguous, with outputs shaped as
        `quantize_fp8_blockwise_gpu` checks them, all on one device."""
        if x.dim() != 2 or x.dtype not in _TRITON_DTYPES:
            return (
                f"input of shape {tuple(x.shape)} and dtype {x.dtype} (2-D float32/bf16/fp16 only)"
            )
        if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != tuple(x.shape):
            return f"weight output {tuple(q.shape)} {q.dtype} does not match the input"
        if s.dtype != torch.float32 or tuple(s.shape) != scale_shape(tuple(x.shape), block):
            return f"scale output {tuple(s.shape)} {s.dtype} does not match the input"
        for what, t in (("input", x), ("weight output", q), ("scale output", s)):
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                return f"{what}'s last dim has stride {t.stride(-1)} (must be contiguous)"
            if t.shape[0] > 1 and t.stride(0) == 0:
                return f"{what} is a broadcast view"
            if t.device != x.device:
                return f"{what} is on {t.device}, the input on {x.device}"
        return None

    def launch(self) -> None:
        """Quantize every call of the table: one launch on the current stream."""
        if self.num_programs == 0:
            return
        import triton.language as tl

        if self._sub_rows:
            kernel = _jit_module().fp8_table_quant2_kernel
        else:
            kernel = _jit_module().fp8_table_quant_kernel
        b0, b1 = self.block
        args = (
            self.units,
            self.block_unit,
            AMAX_FLOOR,
        )
        meta = dict(
            X_DTYPE=getattr(tl, _TRITON_DTYPES[self._dtype]),
            ALIGNED=self._aligned,
            BLOCK_R=b0,
            BLOCK_C=b1,
            TILE_R=_next_pow2(b0),
            TILE_C=_next_pow2(b1),
            FP8_MAX=FP8_MAX,
            SOFTWARE_CVT=self._software,
            num_warps=self._num_warps,
        )
        if self._sub_rows:
            meta["SUB_R"] = self._sub_rows
        if self._num_stages is not None:
            meta["num_stages"] = self._num_stages
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                kernel[(self.num_programs,)](*args, **meta)
        else:
            kernel[(self.num_programs,)](*args, **meta)
