"""Device-independent logic of the ibverbs backend: pure functions and plain data, no pyverbs.

Everything here is unit-tested on machines without an RDMA device (tests/unit/test_ibverbs.py):
option parsing, QP attributes per state transition, GID and NIC selection, the wire formats of
endpoints, descriptors and the bootstrap handshake, work-request splitting, round-robin over
queue pairs, the selective-signalling pattern, send-queue credit accounting and the decoding of
work-completion statuses into the project's errors. `backends/ibverbs.py` converts these plain
values into pyverbs objects.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import cast

import msgpack

from weight_transfer.backends.base import (
    ConfigurationError,
    PeerLostError,
    TransportError,
    TransportTimeoutError,
    WeightTransferError,
)

# ---------------------------------------------------------------------------------------------
# Constants from <infiniband/verbs.h>. Kept here (values are ABI, stable since rdma-core 1.0)
# so that the pure code never imports pyverbs; the device module maps names, not numbers.
# ---------------------------------------------------------------------------------------------

MTU_ENUM_BY_BYTES: dict[int, int] = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
"""Path MTU in bytes -> enum ibv_mtu value."""
MTU_BYTES_BY_ENUM: dict[int, int] = {v: k for k, v in MTU_ENUM_BY_BYTES.items()}

WC_STATUS_NAMES: dict[int, str] = {
    0: "IBV_WC_SUCCESS",
    1: "IBV_WC_LOC_LEN_ERR",
    2: "IBV_WC_LOC_QP_OP_ERR",
    3: "IBV_WC_LOC_EEC_OP_ERR",
    4: "IBV_WC_LOC_PROT_ERR",
    5: "IBV_WC_WR_FLUSH_ERR",
    6: "IBV_WC_MW_BIND_ERR",
    7: "IBV_WC_BAD_RESP_ERR",
    8: "IBV_WC_LOC_ACCESS_ERR",
    9: "IBV_WC_REM_INV_REQ_ERR",
    10: "IBV_WC_REM_ACCESS_ERR",
    11: "IBV_WC_REM_OP_ERR",
    12: "IBV_WC_RETRY_EXC_ERR",
    13: "IBV_WC_RNR_RETRY_EXC_ERR",
    14: "IBV_WC_LOC_RDD_VIOL_ERR",
    15: "IBV_WC_REM_INV_RD_REQ_ERR",
    16: "IBV_WC_REM_ABORT_ERR",
    17: "IBV_WC_INV_EECN_ERR",
    18: "IBV_WC_INV_EEC_STATE_ERR",
    19: "IBV_WC_FATAL_ERR",
    20: "IBV_WC_RESP_TIMEOUT_ERR",
    21: "IBV_WC_GENERAL_ERR",
    22: "IBV_WC_TM_ERR",
    23: "IBV_WC_TM_RNDV_INCOMPLETE",
}
"""enum ibv_wc_status value -> name (values checked against pyverbs 44 in the unit tests)."""

WC_SUCCESS = 0
WC_WR_FLUSH_ERR = 5

LINK_LAYER_INFINIBAND = "InfiniBand"
LINK_LAYER_ETHERNET = "Ethernet"

ACCESS_FLAG_NAMES: tuple[str, ...] = ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE")
"""MR and QP access: local write (the NIC writes into local memory) and remote write."""

MAX_WR_BYTES = 1 << 30
"""Largest byte count one work request carries by default (ibv_sge.length is 32 bits and most
ports report max_msg_sz = 1 GiB or 2 GiB); larger writes are split."""

ENDPOINT_VERSION = 1
HANDSHAKE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Options.
# ---------------------------------------------------------------------------------------------


class GpuRegistration(str, enum.Enum):
    """How GPU memory is registered with the NIC."""

    AUTO = "auto"
    """dma-buf where the driver supports it, else a plain MR on the GPU pointer (peer memory)."""
    DMABUF = "dmabuf"
    PEERMEM = "peermem"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class IbverbsOptions:
    """ibverbs settings, parsed from `TransportConfig.options` (all values arrive as strings)."""

    device: str | None = None
    """RDMA device name (e.g. mlx5_0); None picks the NIC closest to the GPU, else the first."""
    port: int | None = None
    """Port number on the device (1-based); None picks the first active port."""
    gid_index: int | None = None
    """Force this GID index; None selects a RoCE v2 GID with an IPv4 or configured address."""
    num_qps_per_peer: int = 4
    """Reliable-connected queue pairs per peer; writes are spread round-robin over them."""
    max_send_wr: int = 512
    """Send-queue depth per QP, i.e. the bound on outstanding work requests per QP."""
    signal_every: int = 32
    """Request a completion every this many work requests per QP (and for the last of a batch)."""
    max_wr_bytes: int = MAX_WR_BYTES
    """Writes larger than this are split into several work requests."""
    mtu_bytes: int | None = None
    """Force the path MTU; None uses the smaller of both ports' active MTUs."""
    timeout_exp: int = 14
    """Local ACK timeout, 4.096 us * 2**timeout_exp (14 -> about 67 ms)."""
    retry_cnt: int = 7
    """Transport retries before a work request fails with RETRY_EXC_ERR."""
    rnr_retry: int = 7
    """Receiver-not-ready retries (7 means infinite; RDMA WRITE never needs a receive)."""
    min_rnr_timer: int = 12
    """Minimum RNR NAK timer code advertised by our receive side."""
    max_rd_atomic: int = 1
    """Outstanding RDMA reads/atomics we initiate (we initiate none; 1 keeps drivers happy)."""
    max_dest_rd_atomic: int = 1
    """Outstanding RDMA reads/atomics we accept as a target."""
    service_level: int = 0
    """InfiniBand service level / RoCE priority used in the address vector."""
    traffic_class: int = 0
    """GRH traffic class (DSCP << 2 on RoCE v2)."""
    hop_limit: int = 64
    """GRH hop limit."""
    gpu_registration: GpuRegistration = GpuRegistration.AUTO
    """How GPU memory is registered."""
    bootstrap_port: int = 0
    """TCP port of the QP-exchange listener (0: any free port)."""
    advertise_host: str | None = None
    """Host name or address peers use to reach the listener; None uses `listen_host`."""

    def __post_init__(self) -> None:
        def positive(name: str, value: int, upper: int | None = None) -> None:
            if value < 1 or (upper is not None and value > upper):
                bound = f" and <= {upper}" if upper is not None else ""
                raise ConfigurationError(f"ibverbs option {name}={value} must be >= 1{bound}")

        if self.port is not None:
            positive("port", self.port, 255)
        if self.gid_index is not None and self.gid_index < 0:
            raise ConfigurationError(f"ibverbs option gid_index={self.gid_index} must be >= 0")
        positive("num_qps_per_peer", self.num_qps_per_peer, 256)
        positive("max_send_wr", self.max_send_wr, 1 << 16)
        positive("signal_every", self.signal_every)
        if self.signal_every > self.max_send_wr:
            raise ConfigurationError(
                f"ibverbs option signal_every={self.signal_every} must be <= max_send_wr="
                f"{self.max_send_wr}, or the send queue fills with unsignalled requests"
            )
        positive("max_wr_bytes", self.max_wr_bytes, (1 << 31))
        if self.mtu_bytes is not None and self.mtu_bytes not in MTU_ENUM_BY_BYTES:
            raise ConfigurationError(
                f"ibverbs option mtu={self.mtu_bytes} must be one of {sorted(MTU_ENUM_BY_BYTES)}"
            )
        for name, value, upper in (
            ("timeout", self.timeout_exp, 31),
            ("retry_cnt", self.retry_cnt, 7),
            ("rnr_retry", self.rnr_retry, 7),
            ("min_rnr_timer", self.min_rnr_timer, 31),
            ("max_rd_atomic", self.max_rd_atomic, 255),
            ("max_dest_rd_atomic", self.max_dest_rd_atomic, 255),
            ("sl", self.service_level, 15),
            ("traffic_class", self.traffic_class, 255),
            ("hop_limit", self.hop_limit, 255),
        ):
            if not 0 <= value <= upper:
                raise ConfigurationError(f"ibverbs option {name}={value} must be in [0, {upper}]")
        if not 0 <= self.bootstrap_port <= 65535:
            raise ConfigurationError(f"ibverbs option bootstrap_port={self.bootstrap_port} invalid")


_OPTION_FIELDS: dict[str, str] = {
    "device": "device",
    "port": "port",
    "gid_index": "gid_index",
    "num_qps": "num_qps_per_peer",
    "max_send_wr": "max_send_wr",
    "signal_every": "signal_every",
    "max_wr_bytes": "max_wr_bytes",
    "mtu": "mtu_bytes",
    "timeout": "timeout_exp",
    "retry_cnt": "retry_cnt",
    "rnr_retry": "rnr_retry",
    "min_rnr_timer": "min_rnr_timer",
    "max_rd_atomic": "max_rd_atomic",
    "max_dest_rd_atomic": "max_dest_rd_atomic",
    "sl": "service_level",
    "traffic_class": "traffic_class",
    "hop_limit": "hop_limit",
    "gpu_registration": "gpu_registration",
    "bootstrap_port": "bootstrap_port",
    "advertise_host": "advertise_host",
}
"""Option key in `TransportConfig.options` -> `IbverbsOptions` field."""

_STRING_FIELDS = frozenset({"device", "advertise_host"})


def parse_options(options: Iterable[tuple[str, str]]) -> IbverbsOptions:
    """Build `IbverbsOptions` from the config's key/value strings.

    Raises:
        ConfigurationError: an unknown key or a value that does not parse (named).
    """
    kwargs: dict[str, object] = {}
    for key, raw in options:
        field = _OPTION_FIELDS.get(key)
        if field is None:
            raise ConfigurationError(
                f"unknown ibverbs option {key!r}; known options: {sorted(_OPTION_FIELDS)}"
            )
        if field in _STRING_FIELDS:
            if not raw:
                raise ConfigurationError(f"ibverbs option {key} must not be empty")
            kwargs[field] = raw
        elif field == "gpu_registration":
            try:
                kwargs[field] = GpuRegistration(raw)
            except ValueError:
                choices = [g.value for g in GpuRegistration]
                raise ConfigurationError(
                    f"ibverbs option gpu_registration={raw!r} must be one of {choices}"
                ) from None
        else:
            try:
                kwargs[field] = int(raw, 0)
            except ValueError:
                raise ConfigurationError(
                    f"ibverbs option {key}={raw!r} is not an integer"
                ) from None
    return IbverbsOptions(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# QP attributes per transition, as plain data. The device module copies the fields onto a
# pyverbs QPAttr and ORs the named IBV_QP_* mask bits.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class AddressVector:
    """Where an RC QP sends: DLID on InfiniBand, GRH with destination GID on RoCE."""

    port_num: int
    dlid: int
    service_level: int
    is_global: bool
    dgid: bytes
    """16 raw bytes; used only when `is_global`."""
    sgid_index: int
    hop_limit: int
    traffic_class: int


@dataclasses.dataclass(frozen=True, slots=True)
class QpTransition:
    """Attributes for one ibv_modify_qp call and the mask bits that say which are valid."""

    state: str
    """Target state: "INIT", "RTR" or "RTS"."""
    mask: tuple[str, ...]
    """Names of enum ibv_qp_attr_mask bits, IBV_QP_STATE first."""
    values: tuple[tuple[str, object], ...]
    """(QPAttr attribute name, value) pairs; `ah_attr` carries an AddressVector."""

    def value(self, name: str) -> object:
        """The value set for `name`."""
        for key, val in self.values:
            if key == name:
                return val
        raise KeyError(name)


def init_transition(port_num: int, pkey_index: int = 0) -> QpTransition:
    """RESET -> INIT: port, partition key index, remote-write access (RDMA WRITE target)."""
    return QpTransition(
        state="INIT",
        mask=("IBV_QP_STATE", "IBV_QP_PKEY_INDEX", "IBV_QP_PORT", "IBV_QP_ACCESS_FLAGS"),
        values=(
            ("qp_state", "IBV_QPS_INIT"),
            ("pkey_index", pkey_index),
            ("port_num", port_num),
            ("qp_access_flags", ACCESS_FLAG_NAMES),
        ),
    )


def rtr_transition(
    *,
    opts: IbverbsOptions,
    path_mtu_bytes: int,
    remote_qpn: int,
    remote_psn: int,
    av: AddressVector,
) -> QpTransition:
    """INIT -> RTR: path MTU, remote QP number, the PSN we expect from it, address vector."""
    if path_mtu_bytes not in MTU_ENUM_BY_BYTES:
        raise ValueError(f"invalid path MTU {path_mtu_bytes}")
    check_psn(remote_psn)
    if not 0 < remote_qpn < (1 << 24):
        raise ValueError(f"invalid remote QP number {remote_qpn}")
    return QpTransition(
        state="RTR",
        mask=(
            "IBV_QP_STATE",
            "IBV_QP_AV",
            "IBV_QP_PATH_MTU",
            "IBV_QP_DEST_QPN",
            "IBV_QP_RQ_PSN",
            "IBV_QP_MAX_DEST_RD_ATOMIC",
            "IBV_QP_MIN_RNR_TIMER",
        ),
        values=(
            ("qp_state", "IBV_QPS_RTR"),
            ("path_mtu", MTU_ENUM_BY_BYTES[path_mtu_bytes]),
            ("dest_qp_num", remote_qpn),
            ("rq_psn", remote_psn),
            ("max_dest_rd_atomic", opts.max_dest_rd_atomic),
            ("min_rnr_timer", opts.min_rnr_timer),
            ("ah_attr", av),
        ),
    )


RXE_VENDOR_ID = 0xFFFFFF
"""The vendor id Soft-RoCE (rdma_rxe) reports in `ibv_query_device`."""


def effective_retry_cnt(retry_cnt: int, vendor_id: int) -> int:
    """The transport retry count to program on a device.

    On hardware 7 is the largest finite count (the IB spec gives "infinite" only to
    `rnr_retry` 7). Soft-RoCE's completer never decrements a `retry_cnt` of 7 (Linux
    drivers/infiniband/sw/rxe/rxe_comp.c, COMPST_ERROR_RETRY: `if (qp->comp.retry_cnt != 7)
    qp->comp.retry_cnt--;`), so there a peer that stops answering (its link down, its process
    gone) would be retried forever instead of failing with RETRY_EXC_ERR. Seen in the Soft-RoCE
    VM: 207 retries and no completion 12 s after the target's link went down. So 7 becomes 6 on
    rxe: one retry fewer, and a dead peer fails in about 7 x the ACK timeout.
    """
    if vendor_id == RXE_VENDOR_ID and retry_cnt == 7:
        return 6
    return retry_cnt


def rts_transition(*, opts: IbverbsOptions, local_psn: int) -> QpTransition:
    """RTR -> RTS: ACK timeout, retry counts, our first PSN, outstanding reads we initiate."""
    check_psn(local_psn)
    return QpTransition(
        state="RTS",
        mask=(
            "IBV_QP_STATE",
            "IBV_QP_TIMEOUT",
            "IBV_QP_RETRY_CNT",
            "IBV_QP_RNR_RETRY",
            "IBV_QP_SQ_PSN",
            "IBV_QP_MAX_QP_RD_ATOMIC",
        ),
        values=(
            ("qp_state", "IBV_QPS_RTS"),
            ("timeout", opts.timeout_exp),
            ("retry_cnt", opts.retry_cnt),
            ("rnr_retry", opts.rnr_retry),
            ("sq_psn", local_psn),
            ("max_rd_atomic", opts.max_rd_atomic),
        ),
    )


def check_psn(psn: int) -> None:
    """PSNs are 24-bit."""
    if not 0 <= psn < (1 << 24):
        raise ValueError(f"PSN {psn} is not a 24-bit value")


def random_psn() -> int:
    """A random 24-bit initial packet sequence number (as ibv_rc_pingpong does)."""
    return int.from_bytes(os.urandom(3), "little")


def path_mtu(local_active_bytes: int, remote_active_bytes: int, forced: int | None) -> int:
    """The path MTU both ends can use: the forced value if it fits, else the smaller active MTU.

    Raises:
        ConfigurationError: the forced MTU exceeds a port's active MTU.
    """
    common = min(local_active_bytes, remote_active_bytes)
    if forced is None:
        return common
    if forced > common:
        raise ConfigurationError(
            f"ibverbs option mtu={forced} exceeds the active MTU of the path ({common})"
        )
    return forced


def address_vector(
    *,
    opts: IbverbsOptions,
    port_num: int,
    link_layer: str,
    sgid_index: int,
    remote_lid: int,
    remote_gid: bytes,
) -> AddressVector:
    """The address vector towards a peer.

    RoCE (Ethernet) has no LIDs: the GRH with the peer's GID is mandatory. On InfiniBand the
    DLID routes inside the subnet; a GRH is added only when the peer has no LID (a router
    path) or a GID index was forced.
    """
    if len(remote_gid) != 16:
        raise ValueError("remote GID must be 16 bytes")
    if link_layer == LINK_LAYER_ETHERNET:
        use_grh = True
    else:
        use_grh = remote_lid == 0 or opts.gid_index is not None
    if use_grh and remote_gid == bytes(16):
        raise ConfigurationError("the peer published a zero GID; cannot route to it")
    return AddressVector(
        port_num=port_num,
        dlid=0 if link_layer == LINK_LAYER_ETHERNET else remote_lid,
        service_level=opts.service_level,
        is_global=use_grh,
        dgid=remote_gid,
        sgid_index=sgid_index,
        hop_limit=opts.hop_limit,
        traffic_class=opts.traffic_class,
    )


# ---------------------------------------------------------------------------------------------
# GID selection.
# ---------------------------------------------------------------------------------------------


class GidType(str, enum.Enum):
    """GID table entry type, as sysfs gid_attrs/types reports it."""

    IB_ROCE_V1 = "IB/RoCE v1"
    ROCE_V2 = "RoCE v2"


def gid_from_string(text: str) -> bytes:
    """Parse a GID as pyverbs prints it ("fe80:0000:...:0001", 8 groups) or as IPv6 text."""
    try:
        return ipaddress.IPv6Address(text).packed
    except ValueError:
        pass
    groups = text.split(":")
    if len(groups) != 8 or not all(len(g) == 4 for g in groups):
        raise ValueError(f"not a GID: {text!r}")
    return bytes.fromhex("".join(groups))


def gid_to_string(gid: bytes) -> str:
    """IPv6-style text of a 16-byte GID (IPv4-mapped ones print as ::ffff:a.b.c.d)."""
    address = ipaddress.IPv6Address(gid)
    if address.ipv4_mapped is not None:  # Python < 3.13 prints these in hex
        return f"::ffff:{address.ipv4_mapped}"
    return str(address)


def gid_ipv4(gid: bytes) -> str | None:
    """The IPv4 address of an IPv4-mapped GID, else None."""
    mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    return str(mapped) if mapped is not None else None


def select_gid(
    entries: Sequence[tuple[int, GidType, bytes]],
    *,
    link_layer: str,
    forced_index: int | None = None,
) -> int:
    """Choose the source GID index.

    Args:
        entries: (index, type, 16-byte gid) for each populated entry of the port's GID table.
        link_layer: LINK_LAYER_ETHERNET (RoCE) or LINK_LAYER_INFINIBAND.
        forced_index: use this index (it must be populated).

    On RoCE the preference is: RoCE v2 with an IPv4-mapped address, RoCE v2 with a configured
    (global, not link-local) IPv6 address, then RoCE v2 link-local; RoCE v1 only if nothing
    else exists. On InfiniBand index 0 (the port GID) is used.

    Raises:
        ConfigurationError: the forced index is not populated, or no usable GID exists.
    """
    populated = {idx: (gtype, gid) for idx, gtype, gid in entries if gid != bytes(16)}
    if forced_index is not None:
        if forced_index not in populated:
            raise ConfigurationError(
                f"ibverbs option gid_index={forced_index} is not a populated GID table entry "
                f"(populated: {sorted(populated)})"
            )
        return forced_index
    if not populated:
        raise ConfigurationError("the port's GID table is empty (no IP address configured?)")
    if link_layer != LINK_LAYER_ETHERNET:
        return 0 if 0 in populated else min(populated)

    def rank(idx: int) -> tuple[int, int]:
        gtype, gid = populated[idx]
        address = ipaddress.IPv6Address(gid)
        if gtype is GidType.ROCE_V2:
            if address.ipv4_mapped is not None:
                return (0, idx)
            if not address.is_link_local:
                return (1, idx)
            return (2, idx)
        return (3, idx)

    return min(populated, key=rank)


# ---------------------------------------------------------------------------------------------
# NIC selection by PCIe affinity.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class NicCandidate:
    """One RDMA device as seen through sysfs."""

    name: str
    pci_path: tuple[str, ...]
    """PCI hierarchy from the root complex down to the function (empty if not a PCI device)."""
    numa_node: int
    """-1 when unknown."""
    hops: int | None = None
    """PCIe hops to the GPU (None if unknown)."""


def normalize_bus_id(bus_id: str) -> str:
    """'00000000:17:00.0' (CUDA) or '0000:17:00.0' -> '0000:17:00.0' (sysfs), lowercase."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(domain, 16):04x}:{rest}"


def _pci_chain(resolved: Path) -> tuple[str, ...]:
    """The PCI components of a resolved sysfs device path (/sys/devices/pci0000:00/...)."""
    parts = resolved.parts
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            return tuple(parts[i:])
    return ()


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def pci_hops(a: Sequence[str], b: Sequence[str]) -> int | None:
    """Edges between two functions in the PCI tree; None if they share no root complex."""
    if not a or not b or a[0] != b[0]:
        return None
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return (len(a) - common) + (len(b) - common)


def discover_nics(sysfs_root: Path, gpu_bus_id: str | None = None) -> list[NicCandidate]:
    """List /sys/class/infiniband devices with their PCI path, NUMA node and distance to a GPU."""
    ib_class = sysfs_root / "class" / "infiniband"
    if not ib_class.is_dir():
        return []
    gpu_chain: tuple[str, ...] = ()
    if gpu_bus_id is not None:
        gpu_dev = sysfs_root / "bus" / "pci" / "devices" / normalize_bus_id(gpu_bus_id)
        if gpu_dev.exists():
            gpu_chain = _pci_chain(gpu_dev.resolve())
    nics = []
    for entry in sorted(ib_class.iterdir()):
        device = entry / "device"
        chain = _pci_chain(device.resolve()) if device.exists() else ()
        numa = _read_int(device / "numa_node", -1)
        hops = pci_hops(chain, gpu_chain) if gpu_chain else None
        nics.append(NicCandidate(name=entry.name, pci_path=chain, numa_node=numa, hops=hops))
    return nics


def gpu_numa_node(sysfs_root: Path, gpu_bus_id: str) -> int:
    """NUMA node of a GPU from sysfs (-1 if unknown)."""
    path = sysfs_root / "bus" / "pci" / "devices" / normalize_bus_id(gpu_bus_id) / "numa_node"
    return _read_int(path, -1)


def select_nic(
    nics: Sequence[NicCandidate],
    *,
    gpu_numa: int = -1,
    usable: Iterable[str] | None = None,
) -> NicCandidate:
    """Pick the NIC closest to the GPU: fewest PCIe hops, then same NUMA node, then name.

    Args:
        nics: candidates from `discover_nics` (hops filled when the GPU is known).
        gpu_numa: NUMA node of the GPU (-1 if unknown).
        usable: names with an active port; others are skipped (None: all usable).

    Raises:
        ConfigurationError: no candidate is usable.
    """
    allowed = set(usable) if usable is not None else None
    pool = [n for n in nics if allowed is None or n.name in allowed]
    if not pool:
        names = [n.name for n in nics]
        raise ConfigurationError(f"no usable RDMA device with an active port among {names}")

    def rank(n: NicCandidate) -> tuple[int, int, str]:
        hops = n.hops if n.hops is not None else 1 << 20
        same_numa = 0 if gpu_numa >= 0 and n.numa_node == gpu_numa else 1
        return (hops, same_numa, n.name)

    return min(pool, key=rank)


# ---------------------------------------------------------------------------------------------
# Wire formats (msgpack, schema-checked; never pickle).
# ---------------------------------------------------------------------------------------------


def _unpack(data: bytes, what: str) -> object:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=1 << 20)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"{what} is not valid msgpack: {exc}") from exc


def _is_uint(value: object, bits: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < (1 << bits)


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteKey:
    """What the payload of an ibverbs RegionDescriptor carries."""

    rkey: int
    address: int
    """Address the peer puts in the work request for byte 0 of the region (a virtual address
    for plain MRs, the dma-buf IOVA for dma-buf MRs)."""
    length: int

    def to_payload(self) -> bytes:
        """Encode as msgpack [rkey, address, length]."""
        return cast(bytes, msgpack.packb([self.rkey, self.address, self.length], use_bin_type=True))

    @classmethod
    def from_payload(cls, payload: bytes) -> RemoteKey:
        """Decode and check a payload made by `to_payload`.

        Raises:
            ValueError: malformed payload.
        """
        obj = _unpack(payload, "ibverbs region descriptor payload")
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("ibverbs region descriptor payload must be [rkey, address, length]")
        rkey, address, length = obj
        if not (_is_uint(rkey, 32) and _is_uint(address, 64) and _is_uint(length, 64)):
            raise ValueError(f"ibverbs region descriptor payload has invalid fields {obj!r}")
        return cls(rkey=rkey, address=address, length=length)


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """What `IbverbsTransport.endpoint()` publishes: how to reach its QP-exchange listener and
    how to address its port."""

    host: str
    port: int
    """TCP port of the bootstrap listener."""
    cookie: bytes
    """16 random bytes a connecting peer must present; the endpoint only travels through the
    authenticated control plane, so only peers that read it can open queue pairs to us."""
    device: str
    ib_port: int
    link_layer: str
    lid: int
    gid: bytes
    gid_index: int
    active_mtu: int
    """Active MTU of our port in bytes."""

    def to_bytes(self) -> bytes:
        """msgpack map with a version field."""
        return cast(
            bytes,
            msgpack.packb(
                {
                    "v": ENDPOINT_VERSION,
                    "host": self.host,
                    "port": self.port,
                    "cookie": self.cookie,
                    "device": self.device,
                    "ib_port": self.ib_port,
                    "link_layer": self.link_layer,
                    "lid": self.lid,
                    "gid": self.gid,
                    "gid_index": self.gid_index,
                    "mtu": self.active_mtu,
                },
                use_bin_type=True,
            ),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Endpoint:
        """Decode and schema-check.

        Raises:
            ValueError: malformed or from another version.
        """
        obj = _unpack(data, "ibverbs endpoint")
        expected = {
            "v",
            "host",
            "port",
            "cookie",
            "device",
            "ib_port",
            "link_layer",
            "lid",
            "gid",
            "gid_index",
            "mtu",
        }
        if not isinstance(obj, dict) or set(obj) != expected:
            raise ValueError(f"ibverbs endpoint must be a map with fields {sorted(expected)}")
        if obj["v"] != ENDPOINT_VERSION:
            raise ValueError(f"ibverbs endpoint version {obj['v']!r} != {ENDPOINT_VERSION}")
        checks = {
            "host": isinstance(obj["host"], str) and bool(obj["host"]),
            "port": _is_uint(obj["port"], 16) and obj["port"] > 0,
            "cookie": isinstance(obj["cookie"], bytes) and len(obj["cookie"]) == 16,
            "device": isinstance(obj["device"], str),
            "ib_port": _is_uint(obj["ib_port"], 8) and obj["ib_port"] > 0,
            "link_layer": obj["link_layer"] in (LINK_LAYER_ETHERNET, LINK_LAYER_INFINIBAND),
            "lid": _is_uint(obj["lid"], 16),
            "gid": isinstance(obj["gid"], bytes) and len(obj["gid"]) == 16,
            "gid_index": _is_uint(obj["gid_index"], 16),
            "mtu": obj["mtu"] in MTU_ENUM_BY_BYTES,
        }
        bad = sorted(k for k, ok in checks.items() if not ok)
        if bad:
            raise ValueError(f"ibverbs endpoint has invalid field(s) {bad}")
        return cls(
            host=obj["host"],
            port=obj["port"],
            cookie=obj["cookie"],
            device=obj["device"],
            ib_port=obj["ib_port"],
            link_layer=obj["link_layer"],
            lid=obj["lid"],
            gid=obj["gid"],
            gid_index=obj["gid_index"],
            active_mtu=obj["mtu"],
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectRequest:
    """Sent by the connecting (writing) side over the bootstrap socket."""

    cookie: bytes
    name: str
    """The requester's own description of itself, for the target's logs and errors."""
    link_layer: str
    lid: int
    gid: bytes
    active_mtu: int
    qpns: tuple[int, ...]
    psns: tuple[int, ...]
    """Initial send PSN of each of the requester's QPs (the target's expected receive PSN)."""

    def to_bytes(self) -> bytes:
        """msgpack list."""
        return cast(
            bytes,
            msgpack.packb(
                [
                    HANDSHAKE_VERSION,
                    "req",
                    self.cookie,
                    self.name,
                    self.link_layer,
                    self.lid,
                    self.gid,
                    self.active_mtu,
                    list(self.qpns),
                    list(self.psns),
                ],
                use_bin_type=True,
            ),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> ConnectRequest:
        """Decode and check.

        Raises:
            ValueError: malformed request.
        """
        obj = _unpack(data, "ibverbs connect request")
        if not (isinstance(obj, list) and len(obj) == 10 and obj[:2] == [HANDSHAKE_VERSION, "req"]):
            raise ValueError("not an ibverbs connect request of this version")
        _, _, cookie, name, link_layer, lid, gid, mtu, qpns, psns = obj
        ok = (
            isinstance(cookie, bytes)
            and isinstance(name, str)
            and link_layer in (LINK_LAYER_ETHERNET, LINK_LAYER_INFINIBAND)
            and _is_uint(lid, 16)
            and isinstance(gid, bytes)
            and len(gid) == 16
            and mtu in MTU_ENUM_BY_BYTES
            and _qp_list_ok(qpns, psns)
        )
        if not ok:
            raise ValueError("ibverbs connect request has invalid fields")
        return cls(
            cookie=cookie,
            name=name,
            link_layer=link_layer,
            lid=lid,
            gid=gid,
            active_mtu=mtu,
            qpns=tuple(qpns),
            psns=tuple(psns),
        )


def _qp_list_ok(qpns: object, psns: object) -> bool:
    return (
        isinstance(qpns, list)
        and isinstance(psns, list)
        and 0 < len(qpns) <= 256
        and len(qpns) == len(psns)
        and all(_is_uint(q, 24) and q > 0 for q in qpns)
        and all(_is_uint(p, 24) for p in psns)
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectReply:
    """The target's answer: its QPs (already in RTR, paired index by index) or an error."""

    error: str
    """Empty on success."""
    qpns: tuple[int, ...] = ()
    psns: tuple[int, ...] = ()

    def to_bytes(self) -> bytes:
        """msgpack list."""
        return cast(
            bytes,
            msgpack.packb(
                [HANDSHAKE_VERSION, "rep", self.error, list(self.qpns), list(self.psns)],
                use_bin_type=True,
            ),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> ConnectReply:
        """Decode and check.

        Raises:
            ValueError: malformed reply.
        """
        obj = _unpack(data, "ibverbs connect reply")
        if not (isinstance(obj, list) and len(obj) == 5 and obj[:2] == [HANDSHAKE_VERSION, "rep"]):
            raise ValueError("not an ibverbs connect reply of this version")
        _, _, error, qpns, psns = obj
        if not isinstance(error, str):
            raise ValueError("ibverbs connect reply has an invalid error field")
        if error:
            return cls(error=error)
        if not _qp_list_ok(qpns, psns):
            raise ValueError("ibverbs connect reply has invalid QP lists")
        return cls(error="", qpns=tuple(qpns), psns=tuple(psns))


# ---------------------------------------------------------------------------------------------
# Work requests: splitting, round-robin, signalling, credits.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WorkRequest:
    """One RDMA WRITE work request (one SGE)."""

    local_addr: int
    lkey: int
    length: int
    remote_addr: int
    rkey: int


@dataclasses.dataclass(frozen=True, slots=True)
class WriteSpan:
    """A checked write in addresses and keys: what `split_writes` consumes."""

    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int
    length: int


def split_writes(spans: Sequence[WriteSpan], max_wr_bytes: int) -> list[WorkRequest]:
    """One work request per span, spans longer than `max_wr_bytes` cut into consecutive pieces."""
    if max_wr_bytes < 1:
        raise ValueError("max_wr_bytes must be positive")
    out = []
    for s in spans:
        done = 0
        while done < s.length:
            n = min(max_wr_bytes, s.length - done)
            out.append(WorkRequest(s.local_addr + done, s.lkey, n, s.remote_addr + done, s.rkey))
            done += n
    return out


def assign_round_robin(
    wrs: Sequence[WorkRequest], num_qps: int, start: int
) -> tuple[list[list[WorkRequest]], int]:
    """Deal work requests over `num_qps` queue pairs, the first going to QP `start`.

    Returns:
        (per-QP lists in posting order, the QP index the next batch should start at).
    """
    if num_qps < 1:
        raise ValueError("num_qps must be positive")
    lanes: list[list[WorkRequest]] = [[] for _ in range(num_qps)]
    for i, wr in enumerate(wrs):
        lanes[(start + i) % num_qps].append(wr)
    return lanes, (start + len(wrs)) % num_qps


def signal_flags(count: int, unsignaled_before: int, signal_every: int) -> list[bool]:
    """Which of `count` consecutive work requests on one QP request a completion.

    Every `signal_every`-th request since the last signalled one on this QP is signalled, and
    so is the last of the chain, so that (a) the send queue never holds more than
    `signal_every - 1` unsignalled requests whose slots cannot be reclaimed, and (b) the end
    of every chain is observable.

    Args:
        count: requests in the chain.
        unsignaled_before: unsignalled requests posted on this QP since its last signalled one
            (0 when every chain ends signalled, as this module always does).
        signal_every: N.
    """
    if signal_every < 1:
        raise ValueError("signal_every must be positive")
    flags = []
    run = unsignaled_before
    for i in range(count):
        run += 1
        signaled = run >= signal_every or i == count - 1
        flags.append(signaled)
        if signaled:
            run = 0
    return flags


class CreditLedger:
    """Outstanding work requests per QP, bounded by the send-queue depth.

    A slot of the send queue is reclaimed only when a completion for that request or a later
    one on the same QP is polled (RC completes in order). So each signalled request records how
    many requests it covers (itself plus the unsignalled ones before it), and its completion
    returns that many credits.
    """

    def __init__(self, num_qps: int, max_send_wr: int) -> None:
        if num_qps < 1 or max_send_wr < 1:
            raise ValueError("num_qps and max_send_wr must be positive")
        self.max_send_wr = max_send_wr
        self._outstanding = [0] * num_qps
        self._unsignaled = [0] * num_qps
        self._covers: list[dict[int, int]] = [{} for _ in range(num_qps)]

    def available(self, qp: int) -> int:
        """Requests that may be posted on QP `qp` now."""
        return self.max_send_wr - self._outstanding[qp]

    def outstanding(self, qp: int) -> int:
        """Requests posted on QP `qp` and not yet known complete."""
        return self._outstanding[qp]

    def unsignaled(self, qp: int) -> int:
        """Unsignalled requests posted on `qp` since its last signalled one."""
        return self._unsignaled[qp]

    def on_post(self, qp: int, wr_ids: Sequence[int], signaled: Sequence[bool]) -> None:
        """Record a chain posted on `qp`.

        Raises:
            AssertionError: the chain exceeds the available credits (a caller bug).
        """
        assert len(wr_ids) == len(signaled)
        assert len(wr_ids) <= self.available(qp), "posting beyond the send-queue depth"
        self._outstanding[qp] += len(wr_ids)
        for wr_id, sig in zip(wr_ids, signaled, strict=True):
            self._unsignaled[qp] += 1
            if sig:
                self._covers[qp][wr_id] = self._unsignaled[qp]
                self._unsignaled[qp] = 0

    def on_completion(self, qp: int, wr_id: int) -> int:
        """Return the credits a successful completion of signalled `wr_id` frees on `qp`.

        Raises:
            KeyError: `wr_id` is not a signalled request outstanding on `qp`.
        """
        covered = self._covers[qp].pop(wr_id)
        self._outstanding[qp] -= covered
        return covered

    def retire(self, qp: int, wr_id: int) -> int:
        """Like `on_completion`, for any completion (success, error or flush) of `wr_id`:
        the credits it frees, 0 if `wr_id` is not a signalled request outstanding on `qp`
        (a flushed unsignalled one, covered by the signalled request after it)."""
        covered = self._covers[qp].pop(wr_id, 0)
        self._outstanding[qp] -= covered
        return covered

    def reset(self, qp: int) -> None:
        """Forget everything on `qp` (it went to the error state and was drained)."""
        self._outstanding[qp] = 0
        self._unsignaled[qp] = 0
        self._covers[qp].clear()


WR_ID_SEQ_BITS = 32


def make_wr_id(handle_id: int, seq: int) -> int:
    """A 64-bit wr_id naming its batch (high 32 bits) and its sequence (low 32 bits)."""
    return ((handle_id & 0xFFFFFFFF) << WR_ID_SEQ_BITS) | (seq & 0xFFFFFFFF)


def wr_id_handle(wr_id: int) -> int:
    """The batch id encoded by `make_wr_id`."""
    return wr_id >> WR_ID_SEQ_BITS


# ---------------------------------------------------------------------------------------------
# Work-completion status -> the project's errors.
# ---------------------------------------------------------------------------------------------

_PEER_LOST = frozenset({12, 13, 16, 20})
"""RETRY_EXC (no ACK: peer down or unreachable), RNR_RETRY_EXC, REM_ABORT, RESP_TIMEOUT."""

_HINTS: dict[int, str] = {
    1: "a local length exceeded the port's max message size",
    2: "the QP is not in a state that can send (was it transitioned to RTS?)",
    4: "the local buffer is not covered by its memory region (lkey)",
    5: "flushed because the QP entered the error state after an earlier failure",
    8: "local access violation (memory region lacks the needed access flags)",
    9: "the peer rejected the request as invalid",
    10: "the peer refused the write: wrong rkey, address outside its region, or the region "
    "was deregistered",
    11: "the peer could not complete the operation",
    12: "no acknowledgement after all transport retries: the peer is down, unreachable, or "
    "its QP was destroyed",
    13: "receiver-not-ready retries exhausted",
    16: "the peer aborted the operation",
    19: "fatal device error",
    20: "response timeout",
}


def decode_wc_status(
    status: int, *, peer: str, vendor_err: int = 0, qp_num: int = 0
) -> WeightTransferError:
    """The exception for a failed work completion, naming the peer.

    RETRY_EXC, RNR_RETRY_EXC, REM_ABORT and RESP_TIMEOUT mean the peer is gone or unreachable
    (PeerLostError); every other failure is a TransportError.
    """
    if status == WC_SUCCESS:
        raise ValueError("status IBV_WC_SUCCESS is not an error")
    name = WC_STATUS_NAMES.get(status, f"unknown status {status}")
    hint = _HINTS.get(status, "")
    detail = f" ({hint})" if hint else ""
    msg = (
        f"ibverbs: RDMA WRITE to peer {peer!r} failed with {name}{detail}; "
        f"vendor_err=0x{vendor_err:x}, qp_num={qp_num}"
    )
    if status in _PEER_LOST:
        return PeerLostError(msg)
    return TransportError(msg)


def connect_timeout_error(
    peer: str, host: str, port: int, timeout_s: float
) -> TransportTimeoutError:
    """The error for a bootstrap exchange that did not finish in time."""
    return TransportTimeoutError(
        f"ibverbs: QP exchange with peer {peer!r} at {host}:{port} did not finish within "
        f"{timeout_s:.1f} s"
    )
