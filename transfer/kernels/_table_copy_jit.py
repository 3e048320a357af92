"""Triton kernels of `table_copy` (imported only when triton is present)."""

# Triton reads a kernel's parameter annotations as its own type specs (tl.constexpr), so the
# runtime parameters stay unannotated and mypy is told so, for this module only.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 8192
"""8-byte words one loop step of a program moves (64 KiB)."""


@triton.jit
def _copy_chunks(table_ptr, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(table_ptr + row * 2).to(tl.pointer_type(tl.int64))
    dst = tl.load(table_ptr + row * 2 + 1).to(tl.pointer_type(tl.int64))
    src = tl.multiple_of(src, 16)
    dst = tl.multiple_of(dst, 16)
    offs = tl.arange(0, BLOCK)
    for i in range(0, CHUNK_WORDS, BLOCK):
        tl.store(dst + i + offs, tl.load(src + i + offs))


@triton.jit
def _copy_tails(table_ptr, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(table_ptr + row * 3).to(tl.pointer_type(tl.int64))
    dst = tl.load(table_ptr + row * 3 + 1).to(tl.pointer_type(tl.int64))
    words = tl.load(table_ptr + row * 3 + 2) // 8
    src = tl.multiple_of(src, 16)
    dst = tl.multiple_of(dst, 16)
    offs = tl.arange(0, BLOCK)
    for i in range(0, CHUNK_WORDS, BLOCK):
        m = i + offs < words
        tl.store(dst + i + offs, tl.load(src + i + offs, mask=m), mask=m)


def run(
    chunks: torch.Tensor,
    tails: torch.Tensor,
    chunk_bytes: int,
    block_words: int = _BLOCK,
    num_warps: int = 16,
) -> None:
    """Launch both kernels on the current stream (empty parts launch nothing)."""
    words = chunk_bytes // 8
    block = min(block_words, words)
    if words % block or block & (block - 1):
        raise ValueError(f"chunk_bytes {chunk_bytes} must be a power of two of at least 16")
    if chunks.shape[0]:
        _copy_chunks[(chunks.shape[0],)](
            chunks, CHUNK_WORDS=words, BLOCK=block, num_warps=num_warps
        )
    if tails.shape[0]:
        _copy_tails[(tails.shape[0],)](tails, CHUNK_WORDS=words, BLOCK=block, num_warps=num_warps)
