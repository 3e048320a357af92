"""`weight-transfer doctor`: which backends can run on this host, and why the others cannot.

For every backend of `BACKENDS` the doctor first asks `weight_transfer.backends.availability`
(the same checks the test markers use: package missing, no RDMA device, no CUDA GPU); where that
finds nothing missing it loads the backend's class and constructs (then closes) one transport
with a default `TransportConfig`, once for host memory and, where CUDA is available, once with
`device_index=0` for GPU memory. It prints the verdict with the reason of each failure, torch and
CUDA facts, the versions of the optional packages, the ibverbs backend's own device report, the
UCX builds found here (for `ucx` and `nixl`: each build's path, version, transports and the RDMA
ports it sees with their state, which build `ucx`'s default `library=auto` takes and why, and
which one NIXL runs on; `docs/ucx.md`), and which kernels delta mode would run
(`docs/delta.md`). It always exits 0; `--json` prints the same report as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
from typing import Any

import torch

from weight_transfer.backends import availability
from weight_transfer.backends.base import BACKENDS, MemoryKind, TransportConfig, load_backend
from weight_transfer.cli.command import Command
from weight_transfer.kernels import delta

_PACKAGES: dict[str, tuple[str, ...]] = {
    "ucx": ("libucx-cu13",),
    "nixl": ("nixl-cu13",),
}
"""Distributions each optional backend needs (shown with their installed versions)."""


@dataclasses.dataclass(frozen=True, slots=True)
class BackendStatus:
    """The doctor's verdict on one backend."""

    name: str
    host_ok: bool
    """A default transport constructs and registers host memory."""
    host_reason: str | None
    """Why not, when `host_ok` is False."""
    gpu_ok: bool
    """A transport with device_index=0 constructs and registers CUDA memory."""
    gpu_reason: str | None
    """Why not, when `gpu_ok` is False."""
    packages: dict[str, str | None]
    """Optional distributions it needs -> installed version (None: missing)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DoctorReport:
    """Everything `weight-transfer doctor` prints."""

    python: str
    torch: str
    cuda_available: bool
    cuda_devices: list[str]
    rdma_devices: list[str]
    backends: list[BackendStatus]
    ibverbs: dict[str, Any]
    ucx: dict[str, Any]
    """UCX builds here (`backends.ucx_native._builds.doctor_info`)."""
    delta_kernels: str
    """Which count / encode / apply kernels delta mode runs here, and why."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _try_construct(name: str, device_index: int | None) -> str | None:
    """None if a transport of `name` constructs (and supports the memory kind), else why not."""
    try:
        cls = load_backend(name)
        transport = cls(TransportConfig(name=name, device_index=device_index))
    except Exception as exc:  # noqa: BLE001 - the doctor reports every failure, of any type
        return _first_line(exc)
    try:
        kinds = transport.capabilities.memory_kinds
    finally:
        transport.close()
    want = MemoryKind.HOST if device_index is None else MemoryKind.CUDA
    if want not in kinds:
        return f"cannot register {want.value} memory on this host"
    return None


def _ibverbs_info() -> dict[str, Any]:
    try:
        from weight_transfer.backends import ibverbs
    except ImportError as exc:
        return {"error": f"backends.ibverbs does not import: {exc}"}
    info: dict[str, Any] = ibverbs.doctor_info()
    return info


def _ucx_info(rdma: list[str]) -> dict[str, Any]:
    try:
        from weight_transfer.backends.ucx_native import _builds
    except ImportError as exc:
        return {"error": f"backends.ucx_native does not import: {exc}"}
    info: dict[str, Any] = _builds.doctor_info(rdma=rdma)
    return info


def _status(name: str, num_gpus: int) -> BackendStatus:
    packages = {d: _version(d) for d in _PACKAGES.get(name, ())}
    # What is missing (the test markers skip for exactly this), else whether it constructs.
    host_reason = availability.backend_unavailable_reason(name) or _try_construct(name, None)
    gpu_reason: str | None
    if num_gpus == 0:
        gpu_reason = availability.cuda_unavailable_reason() or "no CUDA GPU"
    elif host_reason is not None:
        gpu_reason = host_reason
    else:
        gpu_reason = _try_construct(name, 0)
    return BackendStatus(
        name=name,
        host_ok=host_reason is None,
        host_reason=host_reason,
        gpu_ok=gpu_reason is None,
        gpu_reason=gpu_reason,
        packages=packages,
    )


def collect_report() -> DoctorReport:
    """Probe every backend on this host. Never raises for a backend that cannot run."""
    num_gpus = availability.num_cuda_gpus()
    rdma = availability.rdma_devices()
    return DoctorReport(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_available=num_gpus > 0,
        cuda_devices=[torch.cuda.get_device_name(i) for i in range(num_gpus)],
        rdma_devices=rdma,
        backends=[_status(name, num_gpus) for name in BACKENDS],
        ibverbs=_ibverbs_info(),
        ucx=_ucx_info(rdma),
        delta_kernels=delta.kernels_report(0)
        if num_gpus
        else "torch ops on the CPU (no CUDA GPU; the GPU kernels are Triton and CUDA C)",
    )


def format_report(report: DoctorReport) -> str:
    """The human-readable report."""
    gpus = ", ".join(report.cuda_devices) if report.cuda_devices else "none"
    lines = [
        f"python {report.python}, torch {report.torch}",
        f"CUDA available: {'yes' if report.cuda_available else 'no'} "
        f"({len(report.cuda_devices)} GPU(s): {gpus})",
        f"RDMA devices ({availability.RDMA_SYSFS}): {', '.join(report.rdma_devices) or 'none'}",
        "",
    ]
    width = max(len(b.name) for b in report.backends)
    for b in report.backends:
        pk = ", ".join(f"{d} {v or 'missing'}" for d, v in b.packages.items())
        host = "ok" if b.host_ok else f"no: {b.host_reason}"
        gpu = "ok" if b.gpu_ok else f"no: {b.gpu_reason}"
        lines.append(f"{b.name:<{width}}  host memory: {host}")
        lines.append(f"{'':<{width}}  GPU memory:  {gpu}")
        if pk:
            lines.append(f"{'':<{width}}  packages:    {pk}")
    usable = [b.name for b in report.backends if b.host_ok or b.gpu_ok]
    lines.append("")
    lines.append(f"can run here: {', '.join(usable) or 'nothing'}")
    ib = report.ibverbs
    lines.append(
        f"ibverbs: pyverbs {'present' if ib.get('pyverbs') else 'missing'}"
        f"{' ' + str(ib['version']) if ib.get('version') else ''}, "
        f"{ib.get('num_devices', 0)} device(s)"
        f"{': ' + _first_line(RuntimeError(ib['error'])) if ib.get('error') else ''}"
    )
    for dev in ib.get("devices", []):
        ports = "; ".join(
            f"port {p.get('port')} {p.get('state')} {p.get('link_layer')}"
            for p in dev.get("ports", [])
        )
        lines.append(f"  {dev.get('name')}: {ports or 'no ports'}")
    lines.append(f"  {IBVERBS_TESTED}")
    lines.extend(_format_ucx(report.ucx))
    lines.append(f"delta kernels: {report.delta_kernels}")
    return "\n".join(lines)


IBVERBS_TESTED = (
    "tested: on Soft-RoCE (rxe) in the project's VM, CI's step 7 (conformance, whole updates, "
    "faults); never on an RDMA NIC, with GPU memory, multi-rail or InfiniBand (docs/ibverbs.md)"
)
"""What the ibverbs backend has run on, printed under its devices."""


def _format_ucx(ucx: dict[str, Any]) -> list[str]:
    if ucx.get("error"):
        return [f"UCX builds: {ucx['error']}"]
    auto = ucx.get("ucx_auto", {})
    lines = [
        f"UCX builds (ucx: option `library`; its default auto takes "
        f"{auto.get('library') or 'none'}: {auto.get('why')}):"
    ]
    for b in ucx.get("builds", []):
        users = [
            name
            for name, used in (
                ("ucx auto", b.get("libucp") == auto.get("libucp")),
                ("nixl", b.get("libucp") == ucx.get("nixl_ucx")),
            )
            if used
        ]
        lines.append(
            f"  {b.get('library'):<7} UCX {b.get('version', '?')} {b.get('libucp')}"
            + (f" (used by: {', '.join(users)})" if users else "")
        )
        if b.get("error"):
            lines.append(f"          error: {b['error']}")
            continue
        lines.append(f"          transports: {b.get('transports') or 'none'}")
        lines.append(f"          modules:    {', '.join(b.get('modules', [])) or 'none'}")
        ports = "; ".join(
            f"{p['device']}:{p['port']} {p.get('state') or '?'} ({', '.join(p['transports'])})"
            for p in b.get("rdma_ports", [])
        )
        if ports:
            lines.append(f"          RDMA ports: {ports}")
        elif ucx.get("rdma_devices"):
            lines.append(
                f"          RDMA ports: none of {', '.join(ucx['rdma_devices'])} "
                "(no verbs module, or its libibverbs finds no provider for them)"
            )
        else:
            lines.append("          RDMA ports: none (no RDMA device here)")
    return lines


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _doctor(ns: argparse.Namespace) -> int:
    report = collect_report()
    if ns.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_report(report))
    return 0


COMMANDS = (
    Command(
        "doctor",
        "say which backends can run on this host, and why the others cannot",
        _doctor_args,
        _doctor,
    ),
)
