"""Reference FP8 e4m3 block quantizer (DeepSeek-V3 / Kimi-K2 convention), pure torch.

This is the oracle every other quantizer (the pipeline's, the GPU kernel) must equal bit for
bit. Per block of `block` elements over the last two dimensions: amax = max |x| (computed in
float32), scale = amax / 448 (amax clamped below at `AMAX_FLOOR` so an all-zero block gets a
finite scale), q = float8_e4m3fn(clamp(x / scale, -448, 448)), with IEEE round-to-nearest float32
division. The scale tensor ("weight_scale_inv") holds the dequantization multiplier, shape
`(*leading, ceil(rows / b0), ceil(cols / b1))`; partial edge blocks use only their own elements.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
AMAX_FLOOR = 1e-12
"""Lower bound on a block's amax, so all-zero blocks quantize to zeros with a finite scale."""


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = (128, 128)) -> tuple[int, ...]:
    """Shape of the scale tensor for a weight of `shape`."""
    if len(shape) < 2:
        raise ValueError(f"FP8 block quantization needs at least 2 dims, got shape {shape}")
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def quantize_fp8_blockwise(
    x: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` (any float dtype, >= 2 dims) per block of its last two dimensions.

    Returns:
        (weight float8_e4m3fn of x's shape, scale float32 of `scale_shape(x.shape, block)`).
    """
    if x.dim() < 2:
        raise ValueError(
            f"FP8 block quantization needs at least 2 dims, got shape {tuple(x.shape)}"
        )
    b0, b1 = block
    *lead, rows, cols = x.shape
    nr, nc = math.ceil(rows / b0), math.ceil(cols / b1)
    x32 = x.to(torch.float32)
    pad_r, pad_c = nr * b0 - rows, nc * b1 - cols
    # Padding with zeros never raises a block's amax, so edge blocks see only their own values.
    padded = torch.nn.functional.pad(x32, (0, pad_c, 0, pad_r)) if (pad_r or pad_c) else x32
    blocks = padded.reshape(*lead, nr, b0, nc, b1)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR)
    # Tensor / tensor: PyTorch turns tensor / python-scalar into a multiply by the reciprocal on
    # CUDA, which differs from true division in the last bit about half the time.
    scale = amax / torch.full_like(amax, FP8_MAX)
    expanded = scale.repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)
    expanded = expanded[..., :rows, :cols]
    q = (x32 / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def dequantize_fp8_blockwise(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Float32 reconstruction of a block-quantized tensor (for error-bound checks)."""
    *_, rows, cols = q.shape
    expanded = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.to(torch.float32) * expanded[..., :rows, :cols]
