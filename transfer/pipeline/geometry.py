"""Index arithmetic the stages share: boxes as slices, quantization parts that cover whole
blocks, schedule runs as write ops. Pure functions, no state."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from weight_transfer.backends.base import Region, RegionDescriptor, WriteOp
from weight_transfer.planner.types import Box, Part, QuantWrite, WriteRun, box_shape, numel

ALIGN = 256
"""Staging blocks start on, and are sized in, multiples of this many bytes."""


def round_up(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def slices(box: Box, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
    """`box` as an index, relative to `origin` (the corner of the tensor indexed) if given."""
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin, strict=True))


@dataclasses.dataclass(frozen=True, slots=True)
class AlignedPart:
    """A part of a quantized unit and the rows and columns it covers inside the unit."""

    part: Part
    row0: int
    row1: int
    col0: int
    col1: int


def block_aligned_parts(
    w: QuantWrite, shape: tuple[int, ...], origin: Sequence[int]
) -> list[AlignedPart] | None:
    """Each part's rows and columns inside the unit if every part starts on a block boundary
    and ends on one or at the unit's edge (so no block mixes parts); else None."""
    if any(n != 1 for n in shape[:-2]):
        return None
    rows, cols = shape[-2], shape[-1]
    b0, b1 = w.block
    out = []
    for p in w.parts:
        (r0, r1), (c0, c1) = [
            (a - o, b - o) for (a, b), o in zip(p.dest_box[-2:], origin[-2:], strict=True)
        ]
        if r0 % b0 or c0 % b1 or (r1 % b0 and r1 != rows) or (c1 % b1 and c1 != cols):
            return None
        if numel(box_shape(p.source_box)) != (r1 - r0) * (c1 - c0):
            return None
        out.append(AlignedPart(p, r0, r1, c0, c1))
    return out


def ops_for_runs(
    descriptors: Sequence[RegionDescriptor],
    runs: Sequence[WriteRun],
    source: Region,
    base: int,
    out: list[WriteOp],
) -> None:
    """Append the write ops that send `runs`, read one after another from `source` at `base`."""
    off = base
    for r in runs:
        out.append(WriteOp(source, off, descriptors[r.region], r.offset_bytes, r.nbytes))
        off += r.nbytes
