"""Which UCX build the ucx backend loads: the `library` option resolved to a folder of libraries.

Choices (`LIBRARY_CHOICES`, or a path):

- `wheel`: the `libucx-cu13` wheel's UCX (1.22; the `ucx` extra). Its transports: self, tcp,
  shared memory (sysv, posix), cma, cuda. No InfiniBand module: it cannot do RDMA.
- `system`: the distribution's `libucp.so.0` (Debian/Ubuntu `libucx0`: UCX 1.13 on Debian 12,
  with `libuct_ib` for rc_verbs/ud_verbs and rdmacm, no CUDA), found in the dynamic loader's
  cache (`ldconfig -p`) or in the standard library folders.
- `nixl`: the UCX that the `nixl-cu13` wheel bundles (`site-packages/nixl_cu13.libs`, hashed
  file names; 1.23 with NIXL 1.5.1): InfiniBand (verbs and mlx5), CUDA, tcp, shared memory.
  It carries its own libibverbs, which finds mlx5 built in and other providers only under
  `/usr/lib64/libibverbs` (its build's path): on Debian it sees a Soft-RoCE device only with
  a relinked provider there (tests/softroce/guest.sh makes one).
- a path: a folder holding `libucp.so*` (with its libuct, libucs, libucm, and its modules in
  `ucx/`), for a UCX of your own (HPC-X, a MOFED build, `/opt/ucx/lib`).
- `auto` (default): where the kernel lists an RDMA device, the first of `system`, `nixl` that
  is installed and ships an InfiniBand transport module (for a transport with a CUDA device,
  one that also ships a CUDA module comes first); otherwise `wheel`, or, without the wheel, the
  first build found. Whether the chosen build then sees the device is checked when the
  transport starts (`_tls.check`), not here: resolving loads nothing.

Nothing here loads a library; `_libucp.load` does, once per process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from typing import Any

from weight_transfer.backends.base import EXTRAS
from weight_transfer.backends.ucx_native import _tls, _uct
from weight_transfer.backends.ucx_native._uct import BuildFiles, library_files, module_names
from weight_transfer.errors import (
    ConfigurationError,
    TransportUnavailableError,
    WeightTransferError,
)

__all__ = [
    "LIBRARY_CHOICES",
    "UCX_MODULES_DEFAULT",
    "UcxBuild",
    "describe",
    "doctor_info",
    "find_build",
    "keep_efa_module_out",
    "resolve",
]

logger = logging.getLogger(__name__)

LIBRARY_CHOICES = ("auto", "wheel", "system", "nixl")
"""Values of the ucx backend's `library` option besides a folder path."""

_NIXL_PACKAGES = ("nixl_cu13", "nixl_cu12")
_VERBS_MODULE = "ib"
_CUDA_MODULE = "cuda"
_LDCONFIG_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class UcxBuild:
    """One UCX build on this host: where its libraries are and how it was chosen."""

    library: str
    """`wheel`, `system`, `nixl`, or `path` (a folder the caller named)."""
    files: BuildFiles
    modules: tuple[str, ...]
    """Transport modules it ships (`ib`, `cma`, `cuda`, ...; file names in its `ucx/`)."""

    @property
    def libucp(self) -> str:
        """The real path of its libucp (what identifies the build)."""
        return self.files.ucp

    @property
    def has_verbs_module(self) -> bool:
        """It ships UCX's InfiniBand module (rc_verbs, ud_verbs, ...)."""
        return any(m == _VERBS_MODULE or m.startswith(_VERBS_MODULE + "_") for m in self.modules)

    @property
    def has_efa_module(self) -> bool:
        """It ships UCX's EFA module (`ib_efa`), which must stay unloaded beside rdma-core
        (`keep_efa_module_out`)."""
        return "ib_efa" in self.modules

    @property
    def has_cuda_module(self) -> bool:
        """It ships UCX's CUDA module (cuda_copy, cuda_ipc)."""
        return _CUDA_MODULE in self.modules

    def label(self) -> str:
        """`library=<choice> (<libucp path>)`, for messages."""
        return f"library={self.library} ({self.libucp})"


UCX_MODULES_DEFAULT = "^efa"
"""What `UCX_MODULES` is set to before NIXL's UCX first loads, when the process environment
does not set it (see `keep_efa_module_out`)."""


def keep_efa_module_out() -> None:
    """Keep UCX from loading its `efa` transport module in this process (unless the process
    environment already sets `UCX_MODULES`, which then wins).

    Run by the nixl backend before NIXL first loads its UCX, and by `_libucp.load` before it
    loads a build that ships the module (`UcxBuild.has_efa_module`: NIXL's).

    Why: the UCX that the `nixl-cu13` wheel bundles has an `ib/efa` module that links both the
    wheel's own libibverbs and the host's `libefa.so.1`. On a host with rdma-core installed
    (every RDMA host: Debian's ibverbs-providers ships libefa) loading it brings the host's
    libibverbs and libnl into the same lookup scope as the wheel's copies; the host's libnl then
    registers its traffic-control modules in the wheel's libnl, and unregisters them at exit,
    where the process dies with SIGSEGV (`rtnl_tc_unregister`, during `_dl_fini`), after its
    work is done. Without the module nothing of the host's rdma-core is loaded. UCX reads
    `UCX_MODULES` once per process, when its first library loads, so this must run before
    that; the variable is the only way UCX offers to select modules. Its one cost: UCX's EFA
    transport (AWS) is unavailable in the process; set `UCX_MODULES` yourself to load it.
    """
    if "UCX_MODULES" not in os.environ:
        os.environ["UCX_MODULES"] = UCX_MODULES_DEFAULT
        logger.debug("UCX_MODULES=%s set (keeps UCX's efa module out)", UCX_MODULES_DEFAULT)


def _build(library: str, folder: str) -> UcxBuild:
    files = library_files(folder)
    return UcxBuild(library=library, files=files, modules=tuple(module_names(files)))


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(list(spec.submodule_search_locations)[0])


def _wheel() -> UcxBuild | None:
    pkg = _package_dir("libucx")
    if pkg is None:
        return None
    try:
        return _build("wheel", os.path.join(pkg, "lib"))
    except FileNotFoundError:
        return None


def _nixl() -> UcxBuild | None:
    for name in _NIXL_PACKAGES:
        pkg = _package_dir(name)
        if pkg is None:
            continue
        try:  # auditwheel's folder of bundled libraries sits beside the package
            return _build("nixl", pkg.rstrip(os.sep) + ".libs")
        except FileNotFoundError:
            continue
    return None


def _ldconfig_folders() -> list[str]:
    """Folders of `libucp.so.0` in the dynamic loader's cache (`ldconfig -p`)."""
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "-p"], capture_output=True, text=True, timeout=_LDCONFIG_TIMEOUT_S, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    folders = []
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libucp.so") and path:
            folders.append(os.path.dirname(os.path.realpath(path)))
    return folders


def _standard_folders() -> list[str]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    folders = [
        f"/usr/lib/{multiarch}" if multiarch else "",
        "/usr/lib64",
        "/usr/lib",
        f"/usr/local/lib/{multiarch}" if multiarch else "",
        "/usr/local/lib",
        "/usr/local/lib64",
    ]
    return [f for f in folders if f]


def _system() -> UcxBuild | None:
    seen: set[str] = set()
    for folder in _ldconfig_folders() + _standard_folders():
        real = os.path.realpath(folder)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        try:
            return _build("system", real)
        except FileNotFoundError:
            continue
    return None


_FINDERS = {"wheel": _wheel, "system": _system, "nixl": _nixl}

_MISSING = {
    "wheel": f"the libucx wheel is not installed; install it with: {EXTRAS['ucx']}",
    "system": "no system libucp.so* (not in `ldconfig -p`, nor in the standard library folders; "
    "Debian/Ubuntu: apt-get install libucx0)",
    "nixl": f"the nixl-cu13 wheel (with its bundled UCX) is not installed; install it with: "
    f"{EXTRAS['nixl']}",
}


def find_build(library: str) -> UcxBuild | None:
    """The build that `library` (`wheel`, `system` or `nixl`) names on this host, or None."""
    return _FINDERS[library]()


def resolve(library: str, *, rdma: bool, cuda: bool = False) -> UcxBuild:
    """The build the `library` option names on this host.

    Args:
        library: A choice of `LIBRARY_CHOICES` or a folder holding libucp.so*.
        rdma: The kernel lists an RDMA device (decides `auto`).
        cuda: The transport will register CUDA memory (`auto` then prefers a build with CUDA).

    Raises:
        ConfigurationError: `library` is neither a choice nor a folder with UCX's libraries.
        TransportUnavailableError: the chosen build is not installed here.
    """
    if library == "auto":
        return _auto(rdma=rdma, cuda=cuda)
    if library in _FINDERS:
        build = find_build(library)
        if build is None:
            raise TransportUnavailableError(f"ucx: library={library}: {_MISSING[library]}")
        return build
    if os.path.isabs(library) or os.sep in library:
        if not os.path.isdir(library):
            raise ConfigurationError(f"ucx: library={library!r} is not a folder")
        try:
            return _build("path", os.path.realpath(library))
        except FileNotFoundError as exc:
            raise ConfigurationError(
                f"ucx: library={library!r} does not hold UCX's libraries ({exc})"
            ) from exc
    raise ConfigurationError(
        f"ucx: library={library!r}: expected one of {', '.join(LIBRARY_CHOICES)} or the path "
        "of a folder holding libucp.so*"
    )


def _auto(*, rdma: bool, cuda: bool) -> UcxBuild:
    found = {name: finder() for name, finder in _FINDERS.items()}
    if rdma:
        verbs = [
            b
            for name in ("system", "nixl")
            if (b := found[name]) is not None and b.has_verbs_module
        ]
        if cuda:
            verbs.sort(key=lambda b: not b.has_cuda_module)  # stable: system before nixl
        if verbs:
            return verbs[0]
    for name in ("wheel", "system", "nixl"):
        if (b := found[name]) is not None:
            return b
    raise TransportUnavailableError(
        "ucx: library=auto found no UCX build: " + "; ".join(_MISSING.values())
    )


_DESCRIBE_TIMEOUT_S = 120.0


def describe(build: UcxBuild) -> dict[str, Any]:
    """Version, transports and the RDMA ports of `build`, asked in a child process (`_uct.py`
    as a script: stdlib only), so that this process loads no second build. Never raises.

    The child's environment is this process's, with `UCX_MODULES` kept as the backends keep
    it for a build that ships the efa module (`keep_efa_module_out`), so the child sees what a
    transport on that build would see.
    """
    env = dict(os.environ)
    if build.has_efa_module:
        env.setdefault("UCX_MODULES", UCX_MODULES_DEFAULT)
    info: dict[str, Any] = {"library": build.library, "libucp": build.libucp}
    try:
        run = subprocess.run(
            [sys.executable, _uct.__file__, build.files.folder],
            capture_output=True,
            text=True,
            timeout=_DESCRIBE_TIMEOUT_S,
            env=env,
            check=False,
        )
        info.update(json.loads(run.stdout.strip().splitlines()[-1]))
        resources = [_uct.Resource(**r) for r in info.get("resources", [])]
        info["transports"] = _tls.summary(resources)
        if run.returncode != 0:
            info["error"] = f"the describing process exited with {run.returncode}"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError) as exc:
        info["error"] = f"could not describe it: {exc}"
    return info


def doctor_info(*, rdma: list[str]) -> dict[str, Any]:
    """What `weight-transfer doctor` reports about UCX builds: each build found here (version,
    transports, the RDMA ports it sees with their state), which one the ucx backend's default
    `library=auto` takes and why, and which one the nixl backend runs on. Never raises."""
    builds = [b for name in ("wheel", "system", "nixl") if (b := find_build(name)) is not None]
    out: dict[str, Any] = {"builds": [describe(b) for b in builds], "rdma_devices": rdma}
    try:
        auto = resolve("auto", rdma=bool(rdma))
        why = (
            "the kernel lists RDMA devices and it ships UCX's InfiniBand module"
            if rdma and auto.has_verbs_module
            else "no RDMA device here"
            if not rdma
            else "no installed build ships UCX's InfiniBand module"
        )
        out["ucx_auto"] = {"library": auto.library, "libucp": auto.libucp, "why": why}
    except WeightTransferError as exc:
        out["ucx_auto"] = {"library": None, "libucp": None, "why": str(exc)}
    nixl = find_build("nixl")
    out["nixl_ucx"] = nixl.libucp if nixl is not None else None
    return out
