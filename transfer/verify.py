"""Cheap exact fingerprints of tensors, computed where the tensors live (GPU or CPU).

A fingerprint is the sum over the tensor's 32-bit words of word * (index mod 1021 + 1), modulo
2**64: bit-exact (any changed, moved or missing byte changes it except with negligible
probability on random data) and fast on a GPU, so a benchmark can verify gigabytes of engine
weights after its timed updates without copying them to the host. `expected_fingerprints`
rebuilds each engine tensor from full trainer tensors with the reference recipes, one at a
time, and fingerprints it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from weight_transfer.planner.reference import apply_recipe
from weight_transfer.planner.types import Recipe

_CHUNK = 1 << 26


def fingerprint(t: torch.Tensor) -> int:
    """Position-weighted sum of the tensor's bytes as 32-bit words, mod 2**64."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(start, start + w.numel(), device=b.device, dtype=torch.int64)
        total += (w * (idx % 1021 + 1)).sum()
    return int(total.item()) & ((1 << 64) - 1)


def build_engine_tensor(
    recipe: Recipe, shape: tuple[int, ...], dtype: torch.dtype, full: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The reference value of one recipe's destination (and its scale), on the sources' device
    (`planner.reference.apply_recipe`)."""
    return apply_recipe(recipe, shape, dtype, full)


def expected_fingerprints(
    recipes: Iterable[Recipe],
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    full: Mapping[str, torch.Tensor],
) -> dict[str, int]:
    """Fingerprints of every engine tensor the recipes build from `full` trainer tensors."""
    out: dict[str, int] = {}
    for r in recipes:
        shape, dtype = shapes[r.dest]
        for name, t in build_engine_tensor(r, shape, dtype, full).items():
            out[name] = fingerprint(t)
    return out
