"""The single place for hardware and dependency skips; each reason says what is missing."""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from weight_transfer.backends.base import BACKENDS, EXTRAS

__all__ = [
    "available_backends",
    "backend_unavailable_reason",
    "requires_cuda",
    "requires_gpus",
    "requires_module",
    "requires_rdma_device",
]

_INFINIBAND_SYSFS = "/sys/class/infiniband"


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir(_INFINIBAND_SYSFS))
    except OSError:
        return []


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

requires_rdma_device = pytest.mark.skipif(
    not _rdma_devices(), reason=f"needs an RDMA device ({_INFINIBAND_SYSFS} lists none)"
)


def requires_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless at least `n` CUDA GPUs are visible."""
    have = _num_gpus()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPU(s), this host has {have}")


def requires_module(name: str) -> pytest.MarkDecorator:
    """Skip unless the Python module `name` can be imported."""
    try:
        missing = importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        missing = True
    return pytest.mark.skipif(missing, reason=f"needs Python module {name!r}, not installed")


_BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "ucx": ("libucx", EXTRAS["ucx"]),
    "nixl": ("nixl_cu13", EXTRAS["nixl"]),
    "ibverbs": ("pyverbs", "apt-get install python3-pyverbs"),
}
"""Backend -> (the module it cannot run without, how to install it)."""


def _module_missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


@functools.cache
def backend_unavailable_reason(name: str) -> str | None:
    """Why backend `name` cannot run on this host, or None if it should.

    Only an absent package or absent hardware is a reason: the backend's own constructor is
    not consulted, so a backend whose package is installed but whose constructor is broken
    runs its tests, and they fail.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    package = _BACKEND_PACKAGES.get(name)
    if package is not None and _module_missing(package[0]):
        return f"backend {name!r} needs Python module {package[0]!r}, not installed ({package[1]})"
    if name == "ibverbs" and not _rdma_devices():
        return f"backend 'ibverbs' needs an RDMA device ({_INFINIBAND_SYSFS} lists none)"
    return None


def available_backends() -> list[str]:
    """Names from `BACKENDS` whose packages and hardware are present on this host."""
    return [name for name in BACKENDS if backend_unavailable_reason(name) is None]
