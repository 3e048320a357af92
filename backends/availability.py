"""Can it run here? Backends, CUDA GPUs, RDMA devices and optional modules, each with a reason.

The one place that decides whether a backend can run on this host, used by `weight-transfer
doctor`, by the test markers (`tests/markers.py`) and by the benchmark suites. Every check is a
plain function of the host: it looks for a package without importing it, counts devices, and
returns None when the thing is there or one line saying what is missing (and, for a package, how
to install it). Nothing reads an environment variable or caches an answer.

Only an absent package or absent hardware is a reason here: no backend's constructor is run, so
a backend whose package is installed but whose constructor is broken is "available", and its
tests run and fail. (`weight-transfer doctor` also constructs each available backend and
reports that failure separately.)
"""

from __future__ import annotations

import importlib.util
import os

from weight_transfer.backends.base import BACKENDS, EXTRAS

__all__ = [
    "BACKEND_MODULES",
    "RDMA_SYSFS",
    "available_backends",
    "backend_unavailable_reason",
    "cuda_unavailable_reason",
    "gpus_missing_reason",
    "module_installed",
    "module_missing_reason",
    "num_cuda_gpus",
    "rdma_devices",
    "rdma_unavailable_reason",
    "ucx_library_unavailable_reason",
]

RDMA_SYSFS = "/sys/class/infiniband"
"""Where the kernel lists RDMA devices (one entry per device)."""

BACKEND_MODULES: dict[str, str] = {
    "ucx": "libucx",
    "nixl": "nixl_cu13",
    "ibverbs": "pyverbs",
}
"""Backend name -> the Python module it cannot run without (install hints: `base.EXTRAS`)."""


def module_installed(name: str) -> bool:
    """Whether Python module `name` can be found (it is not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a broken spec
        return False


def module_missing_reason(name: str) -> str | None:
    """None if Python module `name` is installed, else why not."""
    return None if module_installed(name) else f"needs Python module {name!r}, not installed"


def num_cuda_gpus() -> int:
    """CUDA devices torch sees (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_unavailable_reason() -> str | None:
    """None if torch sees a CUDA GPU, else why not."""
    import torch

    if torch.cuda.is_available():
        return None
    return "needs a CUDA GPU (torch.cuda.is_available() is False)"


def gpus_missing_reason(n: int) -> str | None:
    """None if at least `n` CUDA GPUs are visible, else how many there are."""
    have = num_cuda_gpus()
    return None if have >= n else f"needs {n} CUDA GPU(s), this host has {have}"


def rdma_devices() -> list[str]:
    """The RDMA devices the kernel lists (`RDMA_SYSFS`), sorted; empty when there are none."""
    try:
        return sorted(os.listdir(RDMA_SYSFS))
    except OSError:
        return []


def rdma_unavailable_reason() -> str | None:
    """None if the kernel lists an RDMA device, else why not."""
    return None if rdma_devices() else f"needs an RDMA device ({RDMA_SYSFS} lists none)"


def backend_unavailable_reason(name: str) -> str | None:
    """Why backend `name` cannot run on this host, or None if it should.

    Raises:
        ValueError: `name` is not a backend of `BACKENDS`.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    missing = []
    module = BACKEND_MODULES.get(name)
    if module is not None and not module_installed(module):
        hint = EXTRAS.get(name)
        missing.append(f"Python module {module!r}, not installed" + (f" ({hint})" if hint else ""))
    if name == "ibverbs" and not rdma_devices():
        missing.append(f"an RDMA device ({RDMA_SYSFS} lists none)")
    return f"backend {name!r} needs " + " and ".join(missing) if missing else None


def ucx_library_unavailable_reason(library: str) -> str | None:
    """None if the UCX build that the ucx backend's `library` option names is on this host,
    else why not (`backends.ucx_native._builds`; nothing is loaded)."""
    from weight_transfer.backends.ucx_native import _builds
    from weight_transfer.errors import WeightTransferError

    try:
        _builds.resolve(library, rdma=bool(rdma_devices()))
    except WeightTransferError as exc:
        return str(exc)
    return None


def available_backends() -> list[str]:
    """Names of `BACKENDS` whose packages and hardware are present on this host."""
    return [name for name in BACKENDS if backend_unavailable_reason(name) is None]
