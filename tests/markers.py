"""The single place for hardware and dependency skips; each reason says what is missing.

Thin pytest wrappers over `weight_transfer.backends.availability`, the same checks
`weight-transfer doctor` reports, so a skip reason and the doctor's verdict never disagree.
"""

from __future__ import annotations

import functools

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
