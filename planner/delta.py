"""The delta-update wire format's sizes, pure (no torch): what the simulator and the runtime
both need to know about a patch.

A run of `numel` engine elements whose bytes changed in `num_changed` places is sent as a
*sparse chunk list* (chunks of `CHUNK_ELEMENTS`; the chunks' offsets as int64, one entry more
than chunks; a 16-bit index and the new value per changed element, each part padded to 8 bytes)
or, when that is not smaller, *dense* (the run's bytes as a full update would write them).
`weight_transfer.kernels.delta` implements the encoding and its apply; `docs/delta.md`
describes the format.

The sizes here are a model for the simulator and the density measurements: they count
`COUNT_BYTES` (4) per chunk and leave out the offsets' end entry, the padding and the patch
table's 64-byte row per segment, so they are short of the wire by 4 bytes per chunk plus at most
86 bytes per run. The runtime decides sparse or dense from the exact size
(`weight_transfer.delta.patch`).
"""

from __future__ import annotations

import dataclasses
import math

CHUNK_ELEMENTS = 1 << 16
"""Elements per chunk: a 16-bit index addresses any element of its chunk."""

INDEX_BYTES = 2
"""Bytes of one entry's index."""
COUNT_BYTES = 4
"""Bytes per chunk in the size model (the wire carries an int64 offset per chunk: 8)."""


def num_chunks(numel: int) -> int:
    """Chunks of a run of `numel` elements."""
    return -(-numel // CHUNK_ELEMENTS)


def sparse_nbytes(num_changed: int, numel: int, value_bytes: int) -> int:
    """Bytes of the sparse chunk list of a run (counts, indices, values; unpadded)."""
    return COUNT_BYTES * num_chunks(numel) + (INDEX_BYTES + value_bytes) * num_changed


def wire_nbytes(num_changed: int, numel: int, value_bytes: int) -> int:
    """Bytes a run puts on the wire in delta mode: the smaller of sparse and dense."""
    return min(sparse_nbytes(num_changed, numel, value_bytes), numel * value_bytes)


def expected_wire_nbytes(density: float, numel: int, value_bytes: int) -> int:
    """`wire_nbytes` of a run in which a fraction `density` of the elements changed."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density!r}")
    return wire_nbytes(math.ceil(density * numel), numel, value_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeltaDensity:
    """Measured fractions of engine elements that change from one update to the next
    (`benchmarks/bench_delta_density.py` measures them per tensor type)."""

    other: float
    """Fraction of the elements of BF16 (and any non-FP8) engine tensors that changed."""
    fp8: float
    """Fraction of FP8 weight bytes that changed."""
    scales: float = 1.0
    """Fraction of FP8 block scales that changed."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"DeltaDensity.{f.name} must be in [0, 1], got {v!r}")


__all__ = [
    "CHUNK_ELEMENTS",
    "COUNT_BYTES",
    "INDEX_BYTES",
    "DeltaDensity",
    "expected_wire_nbytes",
    "num_chunks",
    "sparse_nbytes",
    "wire_nbytes",
]
