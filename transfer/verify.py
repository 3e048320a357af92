"""Cheap exact fingerprints of tensors, computed where the tensors live (GPU or CPU).

`keyed_digest` is the check the update benchmark applies to every timed update: a keyed
universal hash (two sums over the tensor's 32-bit words times pseudo-random 62-bit keys drawn
from a fresh secret per check with Philox on the tensor's device). It cannot miss a permutation
or any other change except with probability at most 2**-60 per tensor for content that does not
know the key. It is not a cryptographic hash (linear in the data), which is why the key is fresh
and secret for every check. `fingerprint` below is the older, unkeyed index-weighted sum.

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
        w = words[start : start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(start, start + w.numel(), device=b.device, dtype=torch.int64)
        total += (w * (idx % 1021 + 1)).sum()
    return int(total.item()) & ((1 << 64) - 1)


def keyed_digest(t: torch.Tensor, key: int) -> tuple[int, int]:
    """Two keyed sums mod 2**64 of the tensor's bytes as 32-bit words (see the module doc)."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int32)
    g = torch.Generator(device=b.device)
    sums = [torch.zeros((), dtype=torch.int64, device=b.device) for _ in range(2)]
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        for i, acc in enumerate(sums):
            g.manual_seed((key * 2654435761 + start * 2 + i) & ((1 << 63) - 1))
            k = torch.randint(
                0, 1 << 62, (w.numel(),), generator=g, device=b.device, dtype=torch.int64
            )
            acc += (w * k).sum()
    mask = (1 << 64) - 1
    return int(sums[0].item()) & mask, int(sums[1].item()) & mask


def expected_digests(
    recipes: Iterable[Recipe],
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    full: Mapping[str, torch.Tensor],
    key: int,
) -> dict[str, tuple[int, int]]:
    """`keyed_digest` of every engine tensor the recipes build from `full` trainer tensors."""
    out: dict[str, tuple[int, int]] = {}
    for r in recipes:
        shape, dtype = shapes[r.dest]
        for name, t in build_engine_tensor(r, shape, dtype, full).items():
            out[name] = keyed_digest(t, key ^ _name_key(name))
    return out


def _name_key(name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def engine_digests(tensors: Mapping[str, torch.Tensor], key: int) -> dict[str, tuple[int, int]]:
    """`keyed_digest` of each engine tensor, keyed per name as `expected_digests` does."""
    return {n: keyed_digest(t, key ^ _name_key(n)) for n, t in tensors.items()}


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


_M64 = (1 << 64) - 1
_POSITION_CHUNK = 1 << 20


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


_SM_ADD, _SM_M1, _SM_M2 = (
    _signed(0x9E3779B97F4A7C15),
    _signed(0xBF58476D1CE4E5B9),
    _signed(0x94D049BB133111EB),
)


def _lshr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def position_digest(data: torch.Tensor, position: int, key: int) -> int:
    """A keyed digest of bytes that knows where they sit: the sum over the bytes b_i of `data`
    (uint8, flat) of b_i * K(key, position + i) mod 2**64, K a splitmix64 mix of key and
    position, computed on the bytes' device in chunks.

    Linear in the bytes and keyed by absolute position, so the digests of disjoint ranges of a
    region add up to the digest of their union: trainer ranks that each hold some runs of an
    engine tensor can check it together against one digest of the engine's bytes. A change the
    key does not know is missed with probability about 2**-56 per check.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("position_digest takes a flat uint8 tensor")
    total = 0
    seed = _signed(key)
    for start in range(0, data.numel(), _POSITION_CHUNK):
        b = data[start : start + _POSITION_CHUNK].to(torch.int64)
        pos = torch.arange(b.numel(), dtype=torch.int64, device=b.device) + (position + start)
        z = (pos ^ seed) + _SM_ADD
        z = (z ^ _lshr(z, 30)) * _SM_M1
        z = (z ^ _lshr(z, 27)) * _SM_M2
        z = z ^ _lshr(z, 31)
        total += int((b * z).sum().item())
    return total & _M64


def region_position(region: int, offset: int) -> int:
    """The absolute position `position_digest` uses for a byte of an engine's region."""
    return (region << 40) + offset


def name_key(name: str) -> int:
    """Per-engine (or per-tensor) key tweak."""
    return _name_key(name)
