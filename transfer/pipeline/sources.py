"""This rank's trainer tensors as the stages read them, and the checks that they were not
reallocated since the sender registered them (writes from a registered shard, and captured
graphs, read the addresses seen then)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backends.base import Region, WeightTransferError
from weight_transfer.manifest import local_part
from weight_transfer.planner.types import Box

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


@dataclasses.dataclass(slots=True)
class SourceBinding:
    """Where a trainer tensor's local shard lives, for packing and zero-copy writes."""

    param: torch.Tensor
    """The parameter as the trainer holds it (DTensor or plain)."""
    local_box: Box | None
    region: Region | None
    """Registered region covering the local shard's storage (zero-copy), if any."""
    storage_ptr: int
    """data_ptr of the storage when registered, to detect reallocation."""


class Shifted:
    """A local shard that slices like the global tensor: `[box]` takes global coordinates."""

    __slots__ = ("device", "origin", "tensor")

    def __init__(self, tensor: torch.Tensor, origin: tuple[int, ...]) -> None:
        self.tensor = tensor
        self.origin = origin
        self.device = tensor.device

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        shifted = tuple(
            slice(s.start - o, s.stop - o) for s, o in zip(index, self.origin, strict=True)
        )
        for s, n in zip(shifted, self.tensor.shape, strict=True):
            assert 0 <= s.start <= s.stop <= n, "a local task's box lies outside this rank's shard"
        return self.tensor[shifted]


class Sources:
    """The sender's bindings by name, read through the reallocation check."""

    def __init__(self, bindings: Mapping[str, SourceBinding], rank: int) -> None:
        self.bindings = bindings
        self.rank = rank

    def local(self, name: str) -> torch.Tensor:
        """This rank's local tensor of `name`; raises if a registered one was reallocated."""
        b = self.bindings[name]
        local = local_part(b.param)
        if b.region is not None and local.untyped_storage().data_ptr() != b.storage_ptr:
            raise WeightTransferError(
                f"trainer rank {self.rank}: parameter {name!r} was reallocated since the sender "
                "registered it (its storage changed); update parameters in place, or build "
                "a new WeightSender after changing their storage"
            )
        return local

    def local_as_global(self, name: str) -> Shifted:
        """This rank's shard of `name`, indexed in the tensor's global coordinates."""
        b = self.bindings[name]
        if b.local_box is None:
            raise WeightTransferError(
                f"trainer rank {self.rank}: task reads {name!r} from its own shard, but the "
                "shard is not a box (the plan and this rank's manifest disagree)"
            )
        return Shifted(self.local(name), tuple(a for a, _ in b.local_box))

    def pointer_check(self, names: Sequence[str]) -> PointerCheck | None:
        """A `PointerCheck` of these parameters' current addresses."""
        return PointerCheck.of([self.bindings[n].param for n in names])


@dataclasses.dataclass(frozen=True, slots=True)
class PointerCheck:
    """The addresses of many parameters' local tensors, read and compared at C level.

    Built right after each parameter was checked one by one (`Sources.local`); `moved`
    then costs two C-level maps and one list compare, where a Python loop over a MoE model's
    ~19k parameters took longer than the copies. A registered parameter's old storage stays
    alive, so for static batches an unchanged address is unchanged memory; a captured graph
    reads exactly the addresses recorded here, so for it an unchanged address is what it reads.
    """

    params: list[Any]
    getter: Any
    """How to reach each one's local tensor: DTensor's `_local_tensor`, or None (itself)."""
    ptrs: list[int]

    @staticmethod
    def of(params: list[Any]) -> PointerCheck | None:
        """None for a mix of DTensors and plain tensors (checked one by one instead)."""
        if (
            DTensor is not None
            and params
            and all(
                isinstance(p, DTensor)
                and isinstance(getattr(p, "_local_tensor", None), torch.Tensor)
                for p in params
            )
        ):
            getter: Any = operator.attrgetter("_local_tensor")
        elif DTensor is None or not any(isinstance(p, DTensor) for p in params):
            getter = None
        else:
            return None
        return PointerCheck(params, getter, PointerCheck._read(params, getter))

    @staticmethod
    def _read(params: list[Any], getter: Any) -> list[int]:
        return list(map(torch.Tensor.data_ptr, params if getter is None else map(getter, params)))

    def moved(self) -> int | None:
        """Index of the first parameter whose address changed, or None."""
        now = self._read(self.params, self.getter)
        if now == self.ptrs:
            return None
        return next(i for i, (a, b) in enumerate(zip(now, self.ptrs, strict=True)) if a != b)


class UnmovedCheck:
    """Raises if any of a fixed set of parameters was reallocated since registration, cheaply.

    After the first check the addresses of all the parameters are read with C-level `map`s
    and compared with the ones first seen as one list (a MoE model has ~19k parameters: a
    Python loop over them took longer than the copies). A parameter's registered storage stays
    alive, so an unchanged address is unchanged memory. Only when the lists differ is each
    parameter checked (and the offender named).
    """

    def __init__(self, sources: Sources, names: Sequence[str]) -> None:
        self.sources = sources
        self.names = names
        self._seen: dict[str, tuple[torch.Tensor, int]] = {}
        self._fast: PointerCheck | None = None
        """The parameters as last checked one by one."""

    @property
    def ever_checked(self) -> bool:
        """Whether a check has looked at any parameter yet."""
        return bool(self._seen)

    def check(self) -> None:
        """Raise `WeightTransferError` naming the first parameter that was reallocated."""
        if self._fast is not None and self._fast.moved() is None:
            return
        seen = self._seen
        bindings = self.sources.bindings
        for n in self.names:
            local = local_part(bindings[n].param)
            first = seen.get(n)
            if first is not None and first[0] is local and first[1] == local.data_ptr():
                continue
            local = self.sources.local(n)
            seen[n] = (local, local.data_ptr())
        self._fast = self.sources.pointer_check(self.names)
