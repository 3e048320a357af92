"""Build manifests from live torch objects (FSDP2/DTensor trainers, engine tensors)."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from weight_transfer.planner.types import Box, SourceManifest, SourceTensor

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """torch.bfloat16 for "bfloat16"."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def named_tensors(obj: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters of a module (by name), or a copy of a name->tensor mapping.

    Raises:
        TypeError: anything else, or a non-tensor value (named).
    """
    if isinstance(obj, nn.Module):
        return dict(obj.named_parameters(remove_duplicate=False))
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                raise TypeError(f"tensor mapping entry {k!r} is not str -> torch.Tensor")
            out[k] = v
        return out
    raise TypeError(f"expected an nn.Module or a mapping of tensors, got {type(obj).__name__}")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard, or the tensor itself)."""
    if DTensor is not None and isinstance(t, DTensor):
        # The attribute is what to_local() returns, without an autograd call per access.
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t.data if isinstance(t, nn.Parameter) else t


def _dtensor_box(t: Any) -> tuple[Box | None, tuple[int, ...]]:
    """Local box (or None when the shard is not a box) and the mesh's global ranks."""
    mesh = t.device_mesh
    ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    placements = t.placements
    for p in placements:
        if isinstance(p, Partial):
            raise ValueError("a Partial placement cannot be sent: reduce it first")
    # Only plain Shard/Replicate describe a box; _StridedShard (FSDP2 + TP) does not.
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None, ranks
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, shape, strict=True)), ranks


def _same_parameter_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two entries one parameter: the same local memory seen the same way (a state
    dict's detached views of a tied weight), or None when the shard is empty (empty shards
    share no memory, so only the identical object counts)."""
    local = local_part(t)
    if local.numel() == 0:
        return None
    return (
        type(t).__name__,
        str(local.device),
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        local.dtype,
        tuple(t.shape),
    )


def tied_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """Each distinct parameter's first name (in the mapping's order) -> its other names.

    Two names are one parameter when they hold the identical tensor object (a module's
    `named_parameters(remove_duplicate=False)` of tied weights, also under FSDP2) or views of
    the same memory with the same shape, strides and offset (a state dict). The first name
    is the one `named_parameters()` keeps (``model.embed_tokens.weight`` before
    ``lm_head.weight``).
    """
    first_of: dict[Any, str] = {}
    out: dict[str, list[str]] = {}
    for name, t in tensors.items():
        key = _same_parameter_key(t)
        canonical = first_of.get(("id", id(t)))
        if canonical is None and key is not None:
            canonical = first_of.get(key)
        if canonical is None:
            first_of[("id", id(t))] = name
            if key is not None:
                first_of[key] = name
            out[name] = []
        else:
            out[canonical].append(name)
    return {name: tuple(sorted(names)) for name, names in out.items()}


def source_manifest(
    tensors: Mapping[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    compute_device: str,
    host: str | None = None,
) -> SourceManifest:
    """Describe what one trainer rank holds.

    Tied parameters (one tensor under several names, `tied_names`) are described once, under
    their first name, with the others as `SourceTensor.aliases`.

    Args:
        tensors: name -> parameter (DTensor or plain tensor).
        rank, world_size: this rank in the trainer world whose ranks the meshes name.
        compute_device: "cuda" or "cpu": where the trainer computes; a shard living on the CPU
            while the trainer computes on CUDA is marked offloaded.

    Raises:
        ValueError: a tensor cannot be described (Partial placement), naming it.
    """
    aliases = tied_names(tensors)
    out = []
    for name in sorted(aliases):
        t = tensors[name]
        local = local_part(t)
        if DTensor is not None and isinstance(t, DTensor):
            try:
                box, mesh = _dtensor_box(t)
            except ValueError as exc:
                raise ValueError(f"trainer tensor {name!r}: {exc}") from exc
            if box is not None and tuple(local.shape) != tuple(b - a for a, b in box):
                box = None
        else:
            box, mesh = tuple((0, n) for n in t.shape), (rank,)
        out.append(
            SourceTensor(
                name=name,
                shape=tuple(int(n) for n in t.shape),
                dtype=dtype_name(t.dtype),
                local_box=box,
                mesh=mesh,
                device=compute_device,
                offloaded=(compute_device == "cuda" and local.device.type == "cpu"),
                aliases=aliases[name],
            )
        )
    return SourceManifest(
        rank=rank, world_size=world_size, host=host or socket.gethostname(), tensors=tuple(out)
    )


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages behind some tensors, in first-seen order."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        key = (str(t.device), s.data_ptr())
        seen.setdefault(key, s)
    return list(seen.values())


def storage_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a whole storage (registration covers storages, not views)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def allocate_engine_tensors(
    specs: Iterable[Any],
    *,
    device: str | torch.device = "cpu",
    seed: int | None = None,
) -> dict[str, torch.Tensor]:
    """Allocate the tensors an engine rank holds, one per spec (`vllm_tensor_specs(...)`).

    Args:
        specs: `TensorSpec`s (name, shape, dtype), as the presets return them.
        device: where to allocate.
        seed: fill with seeded random values (so an unwritten byte or a wrong offset shows);
            `None` leaves the memory uninitialised (`torch.empty`), as a real engine would.

    Returns:
        name -> tensor, ready for `WeightReceiver`.
    """
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out: dict[str, torch.Tensor] = {}
    for s in specs:
        dt = torch_dtype(s.dtype)
        if g is None:
            out[s.name] = torch.empty(s.shape, dtype=dt, device=device)
        else:
            out[s.name] = torch.randn(s.shape, generator=g).to(dtype=dt, device=device)
    return out
