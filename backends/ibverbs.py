"""Raw ibverbs backend: reliable-connected queue pairs and RDMA WRITE through pyverbs.

Has run on Soft-RoCE (rdma_rxe, in the project's VM), never on an RDMA NIC or with GPU memory (see
docs/ibverbs.md). The device-independent logic lives in
`backends._ibverbs_plan` and is unit-tested; this module converts its plain values into pyverbs
objects (rdma-core's Python binding, pyverbs/*.pyx, cited as "pyverbs qp.pyx" etc. below).

Design in short:
- One device context, protection domain and port per transport. The device is chosen by the
  `device` option or by PCIe distance to the transport's GPU (/sys/class/infiniband/*/device).
- Host memory is registered with a plain MR. GPU memory with a dma-buf MR (the fd comes from
  cuMemGetHandleForAddressRange through ctypes) where the driver supports it, else with a plain
  MR on the GPU pointer, which works when nvidia-peermem is loaded.
- Connection: RC QPs need both sides to know each other's QP number, but in this project only
  the writer calls `connect`. So every transport runs a small TCP listener (the bootstrap
  side channel, like ibv_rc_pingpong's TCP exchange); its address and a random cookie are in
  `endpoint()`. `connect` sends the writer's QP numbers, PSNs, LID and GID (msgpack); the
  target creates as many QPs, brings them to RTR/RTS towards the writer's and answers with
  its own; then the writer brings its QPs to RTR/RTS.
- Writes: each batch becomes RDMA WRITE work requests (large writes split), dealt round-robin
  over the peer's QPs, posted as linked lists with every Nth and the last request signalled,
  never more outstanding per QP than its send-queue depth (the rest is posted from `poll`).
- A failed work completion fails every batch in flight to that peer, with the status decoded
  into PeerLostError (retry exceeded and the like) or TransportError, naming the peer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, cast

import torch

from weight_transfer.backends import _ibverbs_plan as plan
from weight_transfer.backends.base import (
    ConfigurationError,
    MemoryKind,
    PeerLostError,
    Region,
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportCapabilities,
    TransportConfig,
    TransportError,
    TransportUnavailableError,
    WriteHandle,
    WriteOp,
)

__all__ = ["IbverbsTransport", "PyverbsDevice", "doctor_info", "import_pyverbs"]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "pyverbs (rdma-core's Python binding) is not importable. On Debian/Ubuntu: "
    "`apt-get install python3-pyverbs` (it imports only under the system python3 it was built "
    "for), or build it from rdma-core's sources (the PyPI sdist needs `cython<3.1` and the "
    "matching rdma-core libraries); see docs/ibverbs.md"
)
NO_DEVICE_MESSAGE = "no RDMA device found (ibv_get_device_list returned 0)"

_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
_MAX_MESSAGE_BYTES = 1 << 16


# ---------------------------------------------------------------------------------------------
# pyverbs import and discovery.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Pyverbs:
    """The pyverbs modules this backend uses, imported once."""

    device: Any
    enums: Any
    pd: Any
    cq: Any
    qp: Any
    mr: Any
    wr: Any
    addr: Any
    error: Any


def import_pyverbs() -> _Pyverbs:
    """Import pyverbs lazily.

    Raises:
        TransportUnavailableError: pyverbs is missing or broken, with how to install it.
    """
    try:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.enums as enums
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.pyverbs_error as error
        import pyverbs.qp as qp
        import pyverbs.wr as wr
    except ImportError as exc:
        raise TransportUnavailableError(f"ibverbs: {INSTALL_HINT} ({exc})") from exc
    return _Pyverbs(device, enums, pd, cq, qp, mr, wr, addr, error)


def _device_names(pv: _Pyverbs) -> list[str]:
    """Names of the RDMA devices; [] when there are none.

    libibverbs returns NULL (pyverbs raises PyverbsRDMAError "Failed to get devices list") when
    /sys/class/infiniband is absent, and an empty list when it is empty; both mean no device.
    """
    try:
        devices = pv.device.get_device_list()
    except pv.error.PyverbsError as exc:
        logger.debug("ibv_get_device_list failed: %s", exc)
        return []
    names = []
    for dev in devices:
        name = dev.name
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


def _link_layer_name(pv: _Pyverbs, value: int) -> str:
    if value == pv.enums.IBV_LINK_LAYER_ETHERNET:
        return plan.LINK_LAYER_ETHERNET
    return plan.LINK_LAYER_INFINIBAND


def doctor_info() -> dict[str, Any]:
    """What `weight-transfer doctor` reports about this backend. Never raises.

    Returns:
        {"pyverbs": bool, "version": str | None, "error": str | None, "num_devices": int,
         "devices": [{"name", "ports": [{"port", "state", "link_layer", "lid",
         "active_mtu"}]}]}
    """
    info: dict[str, Any] = {
        "pyverbs": False,
        "version": None,
        "error": None,
        "num_devices": 0,
        "devices": [],
    }
    try:
        pv = import_pyverbs()
    except TransportUnavailableError as exc:
        info["error"] = str(exc)
        return info
    info["pyverbs"] = True
    info["version"] = _pyverbs_version()
    names = _device_names(pv)
    info["num_devices"] = len(names)
    if not names:
        info["error"] = NO_DEVICE_MESSAGE
    for name in names:
        entry: dict[str, Any] = {"name": name, "ports": []}
        try:
            with pv.device.Context(name=name) as ctx:
                num_ports = ctx.query_device().phys_port_cnt
                for port in range(1, num_ports + 1):
                    attr = ctx.query_port(port)
                    entry["ports"].append(
                        {
                            "port": port,
                            "state": "active"
                            if attr.state == pv.enums.IBV_PORT_ACTIVE
                            else f"state {attr.state}",
                            "link_layer": _link_layer_name(pv, attr.link_layer),
                            "lid": attr.lid,
                            "active_mtu": plan.MTU_BYTES_BY_ENUM.get(attr.active_mtu, 0),
                        }
                    )
        except Exception as exc:  # doctor reports, never raises
            entry["error"] = f"{type(exc).__name__}: {exc}"
        info["devices"].append(entry)
    return info


def _pyverbs_version() -> str | None:
    from importlib import metadata

    for dist in ("pyverbs", "python3-pyverbs", "rdma-core"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown (no package metadata; Debian's python3-pyverbs ships none)"


# ---------------------------------------------------------------------------------------------
# CUDA helpers (driver API through ctypes; no cuda-python dependency).
# ---------------------------------------------------------------------------------------------


class _CudaDriver:
    """The few CUDA driver calls GPU registration needs."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransportError(f"ibverbs: cannot load libcuda.so.1: {exc}") from exc

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            get_name = getattr(self.lib, "cuGetErrorName", None)
            if get_name is not None:
                get_name(rc, ctypes.byref(name))
            label = name.value.decode() if name.value else f"CUresult {rc}"
            raise TransportError(f"ibverbs: {what} failed with {label}")

    def dma_buf_supported(self, device_index: int) -> bool:
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        value = ctypes.c_int()
        rc = self.lib.cuDeviceGetAttribute(
            ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev
        )
        return rc == 0 and value.value == 1

    def address_range(self, address: int) -> tuple[int, int]:
        base = ctypes.c_uint64()
        size = ctypes.c_size_t()
        fn = self.lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        self._check(fn(ctypes.byref(base), ctypes.byref(size), address), "cuMemGetAddressRange")
        return base.value, size.value

    def dma_buf_fd(self, base: int, size: int) -> int:
        fd = ctypes.c_int(-1)
        fn = getattr(self.lib, "cuMemGetHandleForAddressRange", None)
        if fn is None:
            raise TransportError("ibverbs: the CUDA driver lacks cuMemGetHandleForAddressRange")
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_ulonglong,
        ]
        self._check(
            fn(ctypes.byref(fd), base, size, _CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
            "cuMemGetHandleForAddressRange(DMA_BUF_FD)",
        )
        return fd.value

    def pci_bus_id(self, device_index: int) -> str:
        dev = ctypes.c_int()
        self._check(self.lib.cuInit(0), "cuInit")
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        buf = ctypes.create_string_buffer(32)
        self._check(self.lib.cuDeviceGetPCIBusId(buf, 32, dev), "cuDeviceGetPCIBusId")
        return buf.value.decode()


def _gpu_bus_id(device_index: int) -> str | None:
    """PCI bus id of a CUDA device as sysfs spells it, or None if unknown."""
    try:
        props = torch.cuda.get_device_properties(device_index)
        domain = getattr(props, "pci_domain_id", None)
        bus = getattr(props, "pci_bus_id", None)
        dev = getattr(props, "pci_device_id", None)
        if None not in (domain, bus, dev):
            return f"{domain:04x}:{bus:02x}:{dev:02x}.0"
        return plan.normalize_bus_id(_CudaDriver().pci_bus_id(device_index))
    except Exception as exc:  # only a hint for NIC choice; fall back to the first NIC
        logger.info("ibverbs: cannot read the PCI bus id of cuda:%d: %s", device_index, exc)
        return None


# ---------------------------------------------------------------------------------------------
# The device layer: everything that touches pyverbs. The transport talks to it only through
# these methods, so tests can substitute a simulated device.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class MemoryRegistration:
    """A registered range: keys, and the address work requests use for its byte 0."""

    lkey: int
    rkey: int
    base: int
    """Virtual address for plain MRs; the dma-buf IOVA (pyverbs registers iova = offset)."""
    length: int
    method: str
    """"host", "dmabuf" or "peermem"."""
    handle: Any = None
    """The pyverbs MR."""


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """A polled work completion."""

    wr_id: int
    status: int
    vendor_err: int
    qp_num: int


@dataclasses.dataclass(frozen=True, slots=True)
class PortInfo:
    """The chosen device and port."""

    device: str
    port: int
    link_layer: str
    lid: int
    gid: bytes
    gid_index: int
    active_mtu: int
    max_qp_wr: int
    max_msg_bytes: int
    max_cqe: int
    vendor_id: int = 0
    """The device's IEEE vendor id (`plan.RXE_VENDOR_ID` for Soft-RoCE)."""


class PyverbsDevice:
    """An opened RDMA device: context, port, GID, protection domain. Owns every verbs object.

    Thread-safety: libibverbs calls are thread-safe; the bootstrap thread creates QPs while the
    owner thread posts and polls others.
    """

    def __init__(
        self,
        opts: plan.IbverbsOptions,
        *,
        gpu_index: int | None,
        sysfs_root: Path = Path("/sys"),
    ) -> None:
        self.pv = import_pyverbs()
        e = self.pv.enums
        names = _device_names(self.pv)
        if not names:
            raise TransportUnavailableError(f"ibverbs: {NO_DEVICE_MESSAGE}")
        self.ctx: Any = None
        self.pd: Any = None
        try:
            name = self._choose_device(names, opts, gpu_index, sysfs_root)
            self.ctx = self.pv.device.Context(name=name)
            dev_attr = self.ctx.query_device()
            port = self._choose_port(name, dev_attr.phys_port_cnt, opts.port)
            port_attr = self.ctx.query_port(port)
            link_layer = _link_layer_name(self.pv, port_attr.link_layer)
            entries = []
            for idx in range(port_attr.gid_tbl_len):
                try:
                    gid = plan.gid_from_string(self.ctx.query_gid(port, idx).gid)
                    gtype = self.ctx.query_gid_type(port, idx)
                except self.pv.error.PyverbsError:
                    continue  # unpopulated entries fail to query on some drivers
                kind = (
                    plan.GidType.ROCE_V2
                    if gtype == e.IBV_GID_TYPE_SYSFS_ROCE_V2
                    else plan.GidType.IB_ROCE_V1
                )
                entries.append((idx, kind, gid))
            gid_index = plan.select_gid(entries, link_layer=link_layer, forced_index=opts.gid_index)
            gid = next((g for i, _, g in entries if i == gid_index), bytes(16))
            self.info = PortInfo(
                device=name,
                port=port,
                link_layer=link_layer,
                lid=port_attr.lid,
                gid=gid,
                gid_index=gid_index,
                active_mtu=plan.MTU_BYTES_BY_ENUM.get(port_attr.active_mtu, 1024),
                max_qp_wr=dev_attr.max_qp_wr,
                max_msg_bytes=port_attr.max_msg_sz or plan.MAX_WR_BYTES,
                max_cqe=dev_attr.max_cqe,
                vendor_id=dev_attr.vendor_id,
            )
            self.pd = self.pv.pd.PD(self.ctx)
        except BaseException:
            self.close()
            raise
        self._cuda: _CudaDriver | None = None
        logger.info(
            "ibverbs: using %s port %d (%s, lid %d, gid[%d] %s, mtu %d)",
            name,
            port,
            link_layer,
            self.info.lid,
            gid_index,
            plan.gid_to_string(gid),
            self.info.active_mtu,
        )

    # -- selection ------------------------------------------------------------------------

    def _choose_device(
        self,
        names: list[str],
        opts: plan.IbverbsOptions,
        gpu_index: int | None,
        sysfs_root: Path,
    ) -> str:
        if opts.device is not None:
            if opts.device not in names:
                raise TransportUnavailableError(
                    f"ibverbs: RDMA device {opts.device!r} not found; devices: {names}"
                )
            return opts.device
        usable = [n for n in names if self._has_active_port(n)]
        bus_id = _gpu_bus_id(gpu_index) if gpu_index is not None else None
        nics = plan.discover_nics(sysfs_root, bus_id)
        known = {n.name for n in nics}
        nics += [
            plan.NicCandidate(name=n, pci_path=(), numa_node=-1) for n in names if n not in known
        ]
        nics = [n for n in nics if n.name in names]
        numa = plan.gpu_numa_node(sysfs_root, bus_id) if bus_id else -1
        try:
            return plan.select_nic(nics, gpu_numa=numa, usable=usable).name
        except ConfigurationError as exc:
            raise TransportUnavailableError(f"ibverbs: {exc}") from exc

    def _has_active_port(self, name: str) -> bool:
        try:
            with self.pv.device.Context(name=name) as ctx:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    if ctx.query_port(port).state == self.pv.enums.IBV_PORT_ACTIVE:
                        return True
        except self.pv.error.PyverbsError as exc:
            logger.info("ibverbs: cannot query %s: %s", name, exc)
        return False

    def _choose_port(self, name: str, num_ports: int, forced: int | None) -> int:
        active = self.pv.enums.IBV_PORT_ACTIVE
        if forced is not None:
            if forced > num_ports:
                raise TransportUnavailableError(
                    f"ibverbs: {name} has {num_ports} port(s); port {forced} does not exist"
                )
            if self.ctx.query_port(forced).state != active:
                raise TransportUnavailableError(f"ibverbs: port {forced} of {name} is not active")
            return forced
        for port in range(1, num_ports + 1):
            if self.ctx.query_port(port).state == active:
                return port
        raise TransportUnavailableError(f"ibverbs: {name} has no active port")

    # -- completion queues and queue pairs --------------------------------------------------

    def create_cq(self, depth: int) -> Any:
        return self.pv.cq.CQ(self.ctx, depth, None, None, 0)

    def create_qp(self, cq: Any, max_send_wr: int) -> Any:
        """An RC QP in RESET with selective signalling (sq_sig_all=0; pyverbs defaults to 1)."""
        cap = self.pv.qp.QPCap(
            max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1
        )
        init = self.pv.qp.QPInitAttr(
            qp_type=self.pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0
        )
        return self.pv.qp.QP(self.pd, init)

    @staticmethod
    def qp_num(qp: Any) -> int:
        return int(qp.qp_num)

    def modify_qp(self, qp: Any, transition: plan.QpTransition) -> None:
        attr, mask = to_pyverbs_qp_attr(self.pv, transition)
        qp.modify(attr, mask)

    def post_chain(self, qp: Any, chain: list[tuple[int, plan.WorkRequest, bool]]) -> None:
        """Post work requests as one linked list (one ibv_post_send call)."""
        wrs = build_send_chain(self.pv, chain)
        qp.post_send(wrs[0])
        # pyverbs links the C structs without holding the Python objects (wr.pyx): `wrs`
        # keeps them alive until ibv_post_send has copied them into the send queue.
        del wrs

    def poll(self, cq: Any, max_entries: int) -> list[Completion]:
        npolled, wcs = cq.poll(max_entries)
        return [
            Completion(wr_id=wc.wr_id, status=wc.status, vendor_err=wc.vendor_err, qp_num=wc.qp_num)
            for wc in wcs[:npolled]
        ]

    # -- memory ---------------------------------------------------------------------------

    def _access(self) -> int:
        e = self.pv.enums
        return cast(int, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)

    def register_host(self, address: int, length: int) -> MemoryRegistration:
        try:
            mr = self.pv.mr.MR(self.pd, length, self._access(), address=address)
        except self.pv.error.PyverbsError as exc:
            raise TransportError(
                f"ibverbs: registering {length} bytes of host memory at 0x{address:x} on "
                f"{self.info.device} failed: {exc} (is the locked-memory limit, ulimit -l, "
                "large enough?)"
            ) from exc
        return MemoryRegistration(mr.lkey, mr.rkey, address, length, "host", mr)

    def register_cuda(
        self, address: int, length: int, device_index: int, mode: plan.GpuRegistration
    ) -> MemoryRegistration:
        """Register GPU memory: dma-buf first (unless `mode` says peermem), then peer memory.

        Raises:
            TransportError: neither method works, with both reasons.
        """
        reasons = []
        if mode in (plan.GpuRegistration.AUTO, plan.GpuRegistration.DMABUF):
            try:
                return self._register_dmabuf(address, length, device_index)
            except TransportError as exc:
                reasons.append(f"dma-buf: {exc}")
        if mode in (plan.GpuRegistration.AUTO, plan.GpuRegistration.PEERMEM):
            try:
                mr = self.pv.mr.MR(self.pd, length, self._access(), address=address)
                return MemoryRegistration(mr.lkey, mr.rkey, address, length, "peermem", mr)
            except self.pv.error.PyverbsError as exc:
                reasons.append(f"peer memory (plain MR on the GPU pointer): {exc}")
        raise TransportError(
            f"ibverbs: cannot register {length} bytes of cuda:{device_index} memory with "
            f"{self.info.device}: " + "; ".join(reasons) + ". Use a driver with dma-buf support "
            "(CUDA >= 11.7, Linux >= 5.12, NVIDIA open kernel modules) or load nvidia-peermem."
        )

    def _register_dmabuf(self, address: int, length: int, device_index: int) -> MemoryRegistration:
        if self._cuda is None:
            self._cuda = _CudaDriver()
        cuda = self._cuda
        with torch.cuda.device(device_index):  # makes the primary context current
            if not cuda.dma_buf_supported(device_index):
                raise TransportError(
                    f"cuda:{device_index} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0"
                )
            base, size = cuda.address_range(address)
            fd = cuda.dma_buf_fd(base, size)
        offset = address - base
        try:
            mr = self.pv.mr.DmaBufMR(self.pd, length, self._access(), fd, offset)
        except TypeError as exc:
            raise TransportError(
                f"this pyverbs' DmaBufMR does not take a dma-buf fd ({exc}); rdma-core 44 does"
            ) from exc
        except self.pv.error.PyverbsError as exc:
            raise TransportError(f"ibv_reg_dmabuf_mr failed: {exc}") from exc
        finally:
            os.close(fd)  # the MR holds its own reference to the dma-buf
        # pyverbs' DmaBufMR passes iova = offset to ibv_reg_dmabuf_mr (pyverbs mr.pyx), so work
        # requests address byte k of the tensor as offset + k.
        return MemoryRegistration(mr.lkey, mr.rkey, offset, length, "dmabuf", mr)

    def deregister(self, reg: MemoryRegistration) -> None:
        if reg.handle is not None:
            reg.handle.close()
            reg.handle = None

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the PD and the context (QPs, MRs and CQs must be closed first)."""
        for obj in (self.pd, self.ctx):
            if obj is None:
                continue
            try:
                obj.close()
            except Exception as exc:  # teardown continues; nothing else can be done
                logger.warning("ibverbs: closing %s failed: %s", type(obj).__name__, exc)
        self.pd = None
        self.ctx = None


def to_pyverbs_qp_attr(pv: _Pyverbs, transition: plan.QpTransition) -> tuple[Any, int]:
    """Convert a plain QpTransition into (pyverbs QPAttr, attribute mask)."""
    e = pv.enums
    attr = pv.qp.QPAttr()
    for name, value in transition.values:
        if name == "qp_state":
            attr.qp_state = getattr(e, str(value))
        elif name == "qp_access_flags":
            flags = 0
            for flag in value:  # type: ignore[attr-defined]
                flags |= getattr(e, flag)
            attr.qp_access_flags = flags
        elif name == "ah_attr":
            av = value
            assert isinstance(av, plan.AddressVector)
            gr = None
            if av.is_global:
                gid = pv.addr.GID(":".join(av.dgid[i : i + 2].hex() for i in range(0, 16, 2)))
                gr = pv.addr.GlobalRoute(
                    dgid=gid,
                    sgid_index=av.sgid_index,
                    hop_limit=av.hop_limit,
                    traffic_class=av.traffic_class,
                )
            attr.ah_attr = pv.addr.AHAttr(
                port_num=av.port_num,
                is_global=1 if av.is_global else 0,
                gr=gr,
                dlid=av.dlid,
                sl=av.service_level,
            )
        else:
            setattr(attr, name, value)
    mask = 0
    for bit in transition.mask:
        mask |= getattr(e, bit)
    return attr, mask


def build_send_chain(pv: _Pyverbs, chain: list[tuple[int, plan.WorkRequest, bool]]) -> list[Any]:
    """pyverbs SendWRs for RDMA WRITE, linked head to tail; returns them head first."""
    e = pv.enums
    wrs: list[Any] = []
    nxt = None
    for wr_id, wr, signaled in reversed(chain):
        sge = pv.wr.SGE(wr.local_addr, wr.length, wr.lkey)
        send = pv.wr.SendWR(
            wr_id=wr_id,
            opcode=e.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[sge],
            send_flags=e.IBV_SEND_SIGNALED if signaled else 0,
            next_wr=nxt,
        )
        send.set_wr_rdma(wr.rkey, wr.remote_addr)
        wrs.append(send)
        nxt = send
    wrs.reverse()
    return wrs


# ---------------------------------------------------------------------------------------------
# Bootstrap side channel: length-prefixed msgpack over TCP.
# ---------------------------------------------------------------------------------------------


def _send_msg(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the other side")
        buf += chunk
    return bytes(buf)


def _recv_msg(sock: socket.socket, deadline: float) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4, deadline))
    if n > _MAX_MESSAGE_BYTES:
        raise ValueError(f"bootstrap message of {n} bytes is too large")
    return _recv_exact(sock, n, deadline)


class BootstrapServer:
    """Accepts QP-exchange requests on a TCP port and answers them from a callback.

    The callback receives the request bytes and returns the reply bytes; it runs on the
    server's thread. Every socket operation has a timeout; `close` stops the thread.
    """

    def __init__(self, host: str, port: int, handler: Any, *, timeout_s: float = 30.0) -> None:
        self._handler = handler
        self._timeout_s = timeout_s
        self._sock = socket.create_server((host, port), backlog=64)
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ibverbs-bootstrap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.2)
                if not ready:
                    continue
                conn, addr = self._sock.accept()
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                continue
            with conn:
                try:
                    request = _recv_msg(conn, time.monotonic() + self._timeout_s)
                    _send_msg(conn, self._handler(request))
                except Exception as exc:  # one bad client must not stop the listener
                    logger.warning("ibverbs: bootstrap request from %s failed: %s", addr, exc)

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        finally:
            self._thread.join(timeout=5.0)


def bootstrap_request(host: str, port: int, request: bytes, *, timeout_s: float) -> bytes:
    """Send one request to a BootstrapServer and return its reply, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        _send_msg(sock, request)
        return _recv_msg(sock, deadline)


# ---------------------------------------------------------------------------------------------
# The transport.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False, slots=True)
class _Peer:
    name: str
    cq: Any
    qps: list[Any]
    qpns: list[int]
    ledger: plan.CreditLedger
    next_qp: int = 0
    error: BaseException | None = None
    error_status: int = -1
    batches: dict[int, _Batch] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False, slots=True)
class _Batch:
    handle_id: int
    pending: list[deque[plan.WorkRequest]]
    """Per QP: work requests not yet posted."""
    signaled_outstanding: int = 0
    next_seq: int = 0
    error: BaseException | None = None

    def finished(self) -> bool:
        return self.signaled_outstanding == 0 and not any(self.pending)


class IbverbsTransport(Transport):
    """RDMA WRITE over reliable-connected queue pairs (pyverbs). Needs an RDMA device.

    Options (`TransportConfig.options`): see `backends._ibverbs_plan.IbverbsOptions` and
    docs/ibverbs.md. Not thread-safe (like every Transport), except that the bootstrap thread
    accepts peers' connections at any time.
    """

    option_names = None  # checked by this backend itself (see the module docstring)

    name = "ibverbs"

    def __init__(self, config: TransportConfig, *, device: Any = None) -> None:
        """Open the RDMA device and start the QP-exchange listener.

        Args:
            config: common settings; ibverbs options in `config.options`.
            device: a device-layer object with PyverbsDevice's methods (tests pass a
                simulated one); None opens a real device.

        Raises:
            TransportUnavailableError: pyverbs missing, or no usable RDMA device.
            ConfigurationError: a bad option.
        """
        super().__init__(config)
        self.opts = plan.parse_options(config.options)
        self._dev = (
            device
            if device is not None
            else PyverbsDevice(self.opts, gpu_index=config.device_index)
        )
        self._lock = threading.Lock()
        self._peer_state: dict[str, _Peer] = {}
        self._accepted: list[tuple[str, Any, list[Any]]] = []
        self._regs: dict[int, MemoryRegistration] = {}
        self._rkeys: dict[bytes, plan.RemoteKey] = {}
        self._cookie = os.urandom(16)
        self._target_cq: Any = None
        self._server: BootstrapServer | None = None
        info = self._dev.info
        retry_cnt = plan.effective_retry_cnt(self.opts.retry_cnt, info.vendor_id)
        if retry_cnt != self.opts.retry_cnt:
            logger.info(
                "ibverbs: %s is Soft-RoCE, which retries forever at retry_cnt 7; using %d",
                info.device,
                retry_cnt,
            )
            self.opts = dataclasses.replace(self.opts, retry_cnt=retry_cnt)
        self._max_send_wr = min(self.opts.max_send_wr, info.max_qp_wr)
        self._signal_every = min(self.opts.signal_every, self._max_send_wr)
        self._max_wr_bytes = min(self.opts.max_wr_bytes, info.max_msg_bytes)
        try:
            self._target_cq = self._dev.create_cq(16)
            self._server = BootstrapServer(
                config.listen_host,
                self.opts.bootstrap_port,
                self._on_connect_request,
                timeout_s=config.connect_timeout_s,
            )
        except BaseException:
            self._teardown()
            raise
        self._endpoint_bytes = plan.Endpoint(
            host=self.opts.advertise_host or config.advertise_host or config.listen_host,
            port=self._server.port,
            cookie=self._cookie,
            device=info.device,
            ib_port=info.port,
            link_layer=info.link_layer,
            lid=info.lid,
            gid=info.gid,
            gid_index=info.gid_index,
            active_mtu=info.active_mtu,
        ).to_bytes()

    # -- capabilities -----------------------------------------------------------------------

    def _capabilities(self) -> TransportCapabilities:
        kinds = {MemoryKind.HOST}
        if torch.cuda.is_available():
            kinds.add(MemoryKind.CUDA)
        return TransportCapabilities(memory_kinds=frozenset(kinds), one_sided=True, cross_host=True)

    # -- memory ---------------------------------------------------------------------------

    def _register(self, region_id: int, flat: torch.Tensor, role: RegionRole) -> Region:
        address = flat.data_ptr()
        nbytes = flat.numel()
        kind = MemoryKind.of(flat)
        if kind is MemoryKind.HOST:
            reg = self._dev.register_host(address, nbytes)
            device_index = None
        else:
            device_index = flat.device.index if flat.device.index is not None else 0
            reg = self._dev.register_cuda(address, nbytes, device_index, self.opts.gpu_registration)
        self._regs[region_id] = reg
        descriptor = None
        if role is RegionRole.TARGET:
            payload = plan.RemoteKey(rkey=reg.rkey, address=reg.base, length=nbytes).to_payload()
            descriptor = RegionDescriptor(
                backend=self.name, kind=kind, nbytes=nbytes, payload=payload
            )
        logger.debug("ibverbs: registered region %d (%s, %d bytes)", region_id, reg.method, nbytes)
        return Region(
            region_id=region_id,
            address=address,
            nbytes=nbytes,
            kind=kind,
            device_index=device_index,
            role=role,
            descriptor=descriptor,
            tensor=flat,
        )

    def _deregister(self, region: Region) -> None:
        reg = self._regs.pop(region.region_id)
        self._dev.deregister(reg)

    # -- connection -------------------------------------------------------------------------

    def _endpoint(self) -> bytes:
        return self._endpoint_bytes

    def _local_request_fields(self) -> dict[str, Any]:
        info = self._dev.info
        return {
            "link_layer": info.link_layer,
            "lid": info.lid,
            "gid": info.gid,
            "active_mtu": info.active_mtu,
        }

    def _bring_up(
        self,
        qp: Any,
        *,
        remote_qpn: int,
        remote_psn: int,
        local_psn: int,
        path_mtu: int,
        remote_lid: int,
        remote_gid: bytes,
    ) -> None:
        info = self._dev.info
        av = plan.address_vector(
            opts=self.opts,
            port_num=info.port,
            link_layer=info.link_layer,
            sgid_index=info.gid_index,
            remote_lid=remote_lid,
            remote_gid=remote_gid,
        )
        self._dev.modify_qp(
            qp,
            plan.rtr_transition(
                opts=self.opts,
                path_mtu_bytes=path_mtu,
                remote_qpn=remote_qpn,
                remote_psn=remote_psn,
                av=av,
            ),
        )
        self._dev.modify_qp(qp, plan.rts_transition(opts=self.opts, local_psn=local_psn))

    def _on_connect_request(self, data: bytes) -> bytes:
        """Bootstrap thread: create target-side QPs paired with the requester's."""
        try:
            req = plan.ConnectRequest.from_bytes(data)
        except ValueError as exc:
            return plan.ConnectReply(error=f"malformed request: {exc}").to_bytes()
        if not hmac.compare_digest(req.cookie, self._cookie):
            logger.warning("ibverbs: rejected a connect request with a wrong cookie")
            return plan.ConnectReply(error="wrong cookie").to_bytes()
        if req.link_layer != self._dev.info.link_layer:
            return plan.ConnectReply(
                error=f"link layer mismatch: {req.link_layer} vs {self._dev.info.link_layer}"
            ).to_bytes()
        qps: list[Any] = []
        try:
            mtu = plan.path_mtu(self._dev.info.active_mtu, req.active_mtu, self.opts.mtu_bytes)
            psns = []
            for remote_qpn, remote_psn in zip(req.qpns, req.psns, strict=True):
                qp = self._dev.create_qp(self._target_cq, 1)
                qps.append(qp)
                self._dev.modify_qp(qp, plan.init_transition(self._dev.info.port))
                psn = plan.random_psn()
                self._bring_up(
                    qp,
                    remote_qpn=remote_qpn,
                    remote_psn=remote_psn,
                    local_psn=psn,
                    path_mtu=mtu,
                    remote_lid=req.lid,
                    remote_gid=req.gid,
                )
                psns.append(psn)
        except Exception as exc:  # reported to the requester, which raises
            self._close_qps(qps)
            logger.warning("ibverbs: accepting QPs from %r failed: %s", req.name, exc)
            return plan.ConnectReply(error=f"{type(exc).__name__}: {exc}").to_bytes()
        with self._lock:
            self._accepted.append((req.name, None, qps))
        logger.info("ibverbs: accepted %d QP(s) from %r", len(qps), req.name)
        return plan.ConnectReply(
            error="", qpns=tuple(self._dev.qp_num(q) for q in qps), psns=tuple(psns)
        ).to_bytes()

    def _connect(self, peer: str, endpoint: bytes) -> None:
        try:
            remote = plan.Endpoint.from_bytes(endpoint)
        except ValueError as exc:
            raise ValueError(f"ibverbs: endpoint of peer {peer!r} is invalid: {exc}") from exc
        info = self._dev.info
        if remote.link_layer != info.link_layer:
            raise PeerLostError(
                f"ibverbs: peer {peer!r} is on {remote.link_layer}, this port is "
                f"{info.link_layer}; they cannot form a queue pair"
            )
        mtu = plan.path_mtu(info.active_mtu, remote.active_mtu, self.opts.mtu_bytes)
        n = self.opts.num_qps_per_peer
        cq = None
        qps: list[Any] = []
        try:
            cq = self._dev.create_cq(min(n * self._max_send_wr, info.max_cqe))
            for _ in range(n):
                qp = self._dev.create_qp(cq, self._max_send_wr)
                qps.append(qp)
                self._dev.modify_qp(qp, plan.init_transition(info.port))
            psns = [plan.random_psn() for _ in qps]
            request = plan.ConnectRequest(
                cookie=remote.cookie,
                name=f"{info.device}:{info.port}/{plan.gid_to_string(info.gid)}",
                qpns=tuple(self._dev.qp_num(q) for q in qps),
                psns=tuple(psns),
                **self._local_request_fields(),
            )
            timeout = self.config.connect_timeout_s
            try:
                raw = bootstrap_request(
                    remote.host, remote.port, request.to_bytes(), timeout_s=timeout
                )
            except TimeoutError as exc:
                raise plan.connect_timeout_error(peer, remote.host, remote.port, timeout) from exc
            except OSError as exc:
                raise PeerLostError(
                    f"ibverbs: cannot reach peer {peer!r}'s QP-exchange listener at "
                    f"{remote.host}:{remote.port}: {exc}"
                ) from exc
            try:
                reply = plan.ConnectReply.from_bytes(raw)
            except ValueError as exc:
                raise PeerLostError(f"ibverbs: peer {peer!r} sent a bad reply: {exc}") from exc
            if reply.error:
                raise PeerLostError(f"ibverbs: peer {peer!r} refused the connection: {reply.error}")
            if len(reply.qpns) != len(qps):
                raise PeerLostError(
                    f"ibverbs: peer {peer!r} answered with {len(reply.qpns)} QPs, asked {len(qps)}"
                )
            for qp, psn, rqpn, rpsn in zip(qps, psns, reply.qpns, reply.psns, strict=True):
                self._bring_up(
                    qp,
                    remote_qpn=rqpn,
                    remote_psn=rpsn,
                    local_psn=psn,
                    path_mtu=mtu,
                    remote_lid=remote.lid,
                    remote_gid=remote.gid,
                )
        except BaseException:
            self._close_qps(qps)
            self._close_obj(cq)
            raise
        self._peer_state[peer] = _Peer(
            name=peer,
            cq=cq,
            qps=qps,
            qpns=[self._dev.qp_num(q) for q in qps],
            ledger=plan.CreditLedger(len(qps), self._max_send_wr),
        )
        logger.info("ibverbs: connected to %r with %d QP(s), path MTU %d", peer, len(qps), mtu)

    def _disconnect(self, peer: str) -> None:
        state = self._peer_state.pop(peer, None)
        if state is None:
            return
        lost = PeerLostError(f"ibverbs: peer {peer!r} was disconnected with writes in flight")
        for batch in state.batches.values():
            batch.error = batch.error or lost
        self._close_qps(state.qps)
        self._close_obj(state.cq)

    # -- writes ---------------------------------------------------------------------------

    def _remote_key(self, descriptor: RegionDescriptor) -> plan.RemoteKey:
        key = self._rkeys.get(descriptor.payload)
        if key is None:
            key = plan.RemoteKey.from_payload(descriptor.payload)
            if key.length != descriptor.nbytes:
                raise ValueError(
                    f"ibverbs descriptor length {key.length} != descriptor nbytes "
                    f"{descriptor.nbytes}"
                )
            if len(self._rkeys) > 65536:
                self._rkeys.clear()
            self._rkeys[descriptor.payload] = key
        return key

    def _post_writes(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        state = self._peer_state[peer]
        if state.error is not None:
            raise PeerLostError(f"ibverbs: peer {peer!r} failed earlier: {state.error}")
        spans = []
        for i, op in enumerate(ops):
            try:
                remote = self._remote_key(op.target)
            except ValueError as exc:
                raise ValueError(f"write {i} to {peer!r}: {exc}") from exc
            local = self._regs[op.source.region_id]
            spans.append(
                plan.WriteSpan(
                    local_addr=local.base + op.source_offset,
                    lkey=local.lkey,
                    remote_addr=remote.address + op.target_offset,
                    rkey=remote.rkey,
                    length=op.nbytes,
                )
            )
        wrs = plan.split_writes(spans, self._max_wr_bytes)
        lanes, state.next_qp = plan.assign_round_robin(wrs, len(state.qps), state.next_qp)
        batch = _Batch(handle_id=handle.handle_id, pending=[deque(lane) for lane in lanes])
        state.batches[handle.handle_id] = batch
        handle.state = batch
        self._progress(state)

    def _poll(self, handle: WriteHandle) -> bool:
        batch: _Batch = handle.state
        state = self._peer_state.get(handle.peer)
        if state is not None and batch.error is None:
            self._progress(state)
        if batch.error is not None:
            # Kept in the peer's batches until its posted requests are accounted for
            # (`_quiesce`): the other QPs of the peer may still be executing them.
            raise batch.error
        if batch.finished():
            assert state is not None
            state.batches.pop(batch.handle_id, None)
            return True
        return False

    def _quiesce(self, handle: WriteHandle) -> bool:
        # A peer's error stops posting, but requests already posted on its other QPs still
        # execute (only the QP that hit the error is flushed), reading their source memory. A
        # batch is quiet once the last request of every chain it posted (always signalled) has
        # completed, with success, an error or a flush: RC completes in order on a QP. A peer
        # that was disconnected had its QPs destroyed: nothing of it runs.
        batch: _Batch = handle.state
        state = self._peer_state.get(handle.peer)
        if state is None:
            return True
        self._reap(state)
        if batch.signaled_outstanding > 0:
            return False
        state.batches.pop(batch.handle_id, None)
        return True

    def _reap(self, state: _Peer) -> None:
        """Poll the peer's CQ until it is empty, accounting every completion."""
        completions = self._dev.poll(state.cq, 64)
        while completions:
            for wc in completions:
                self._on_completion(state, wc)
            completions = self._dev.poll(state.cq, 64)

    def _progress(self, state: _Peer) -> None:
        """Reap completions of one peer, then post whatever its credits allow."""
        if state.error is None:
            self._reap(state)
        if state.error is not None:
            for batch in state.batches.values():
                batch.error = batch.error or state.error
            return
        for batch in list(state.batches.values()):
            for qp_index, lane in enumerate(batch.pending):
                if not lane:
                    continue
                n = min(len(lane), state.ledger.available(qp_index))
                if n <= 0:
                    continue
                flags = plan.signal_flags(n, state.ledger.unsignaled(qp_index), self._signal_every)
                chain = []
                for signaled in flags:
                    wr_id = plan.make_wr_id(batch.handle_id, batch.next_seq)
                    batch.next_seq += 1
                    chain.append((wr_id, lane.popleft(), signaled))
                try:
                    self._dev.post_chain(state.qps[qp_index], chain)
                except Exception as exc:  # ibv_post_send returned an errno
                    state.error = TransportError(
                        f"ibverbs: posting {len(chain)} RDMA WRITE(s) to peer {state.name!r} "
                        f"failed: {exc}"
                    )
                    for b in state.batches.values():
                        b.error = b.error or state.error
                    return
                state.ledger.on_post(qp_index, [c[0] for c in chain], flags)
                batch.signaled_outstanding += sum(flags)

    def _on_completion(self, state: _Peer, wc: Completion) -> None:
        batch = state.batches.get(plan.wr_id_handle(wc.wr_id))
        if wc.status != plan.WC_SUCCESS:
            # The first real cause wins over the flush errors it triggers on other requests.
            if state.error is None or (
                state.error_status == plan.WC_WR_FLUSH_ERR and wc.status != plan.WC_WR_FLUSH_ERR
            ):
                state.error = plan.decode_wc_status(
                    wc.status, peer=state.name, vendor_err=wc.vendor_err, qp_num=wc.qp_num
                )
                state.error_status = wc.status
        try:
            qp_index = state.qpns.index(wc.qp_num)
        except ValueError:
            logger.warning("ibverbs: completion for unknown QP %d from %r", wc.qp_num, state.name)
            return
        # A failed or flushed request completes too (and, flushed, even if it was posted
        # unsignalled): only a signalled one retires its chain's credits and counts for its
        # batch, whatever its status, so `_quiesce` knows when nothing of a batch runs.
        if state.ledger.retire(qp_index, wc.wr_id) and batch is not None:
            batch.signaled_outstanding -= 1

    # -- teardown -------------------------------------------------------------------------

    def _close_obj(self, obj: Any) -> None:
        if obj is None:
            return
        try:
            obj.close()
        except Exception as exc:  # teardown continues
            logger.warning("ibverbs: closing %s failed: %s", type(obj).__name__, exc)

    def _close_qps(self, qps: list[Any]) -> None:
        for qp in qps:
            self._close_obj(qp)

    def _teardown(self) -> None:
        """Stop the listener, then close QPs, MRs, CQs, PD and context, in that order."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for peer in list(self._peer_state):
            self._close_qps(self._peer_state[peer].qps)
        with self._lock:
            accepted, self._accepted = self._accepted, []
        for _, _, qps in accepted:
            self._close_qps(qps)
        for reg in self._regs.values():
            try:
                self._dev.deregister(reg)
            except Exception as exc:  # teardown continues
                logger.warning("ibverbs: deregistering a region failed: %s", exc)
        self._regs.clear()
        for state in self._peer_state.values():
            self._close_obj(state.cq)
        self._peer_state.clear()
        self._close_obj(self._target_cq)
        self._target_cq = None
        self._dev.close()

    def _close(self) -> None:
        self._teardown()
