"""FP8 block quantization as the stages call it: the default quantizer, and the table quantizer
that turns many small quantize calls of a graph group into one launch per block shape."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

QuantFn = Callable[[torch.Tensor, tuple[int, int], torch.Tensor, torch.Tensor], None]
"""quantize(source, block, out_weight, out_scale): FP8 e4m3 block quantization in place."""


def default_quantize(
    x: torch.Tensor, block: tuple[int, int], out_q: torch.Tensor, out_s: torch.Tensor
) -> None:
    """Quantize into `out_q`/`out_s` with the GPU kernel on CUDA, else the reference."""
    if x.is_cuda:
        from weight_transfer.kernels.fp8_triton import quantize_fp8

        quantize_fp8(x, block, out_q=out_q, out_scale=out_s)
        return
    from weight_transfer.planner.fp8 import quantize_fp8_blockwise

    q, s = quantize_fp8_blockwise(x, block)
    out_q.copy_(q)
    out_s.copy_(s)


@dataclasses.dataclass(frozen=True, slots=True)
class QuantCall:
    """One quantize call captured in a graph group's CUDA graph."""

    src: torch.Tensor
    block: tuple[int, int]
    q: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class TableLaunch:
    """One launch over a `QuantTable` (kept alive by the graph group that captured it)."""

    table: Any

    def __call__(self) -> None:
        self.table.launch()


def quantize_launches(
    calls: Sequence[QuantCall], quantize: QuantFn, *, table: bool
) -> list[Callable[[], None]]:
    """The launches that run `calls`. With the default quantizer and `table`, calls of one
    block shape and input dtype that the table kernel takes become one launch over a
    `QuantTable` (a MoE layer's experts: one launch, not hundreds of small ones); the rest
    (and every call of a custom `quantize`) are one call each."""
    if quantize is not default_quantize or not table:
        return [functools.partial(quantize, c.src, c.block, c.q, c.scale) for c in calls]
    from weight_transfer.kernels.fp8_triton import QuantTable

    tables: dict[tuple[tuple[int, int], torch.dtype], list[QuantCall]] = {}
    launches: list[Callable[[], None]] = []
    for c in calls:
        if QuantTable.why_not(c.src, c.q, c.scale, c.block) is None:
            tables.setdefault((c.block, c.src.dtype), []).append(c)
        else:
            launches.append(functools.partial(quantize, c.src, c.block, c.q, c.scale))
    for (block, _dtype), members in tables.items():
        launches.append(TableLaunch(QuantTable([(c.src, c.q, c.scale) for c in members], block)))
    return launches


def table_tensors(launches: Sequence[Callable[[], None]]) -> list[torch.Tensor]:
    """The device tensors the table launches read (kept alive while their graph lives)."""
    return [
        t
        for launch in launches
        if isinstance(launch, TableLaunch)
        for t in (launch.table.units, launch.table.block_unit)
    ]
