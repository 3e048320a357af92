"""Unit tests of the ibverbs backend that need no RDMA device.

Pure logic (`backends._ibverbs_plan`) is tested directly. The transport itself runs end to end
on a simulated device (`FakeDevice` below: it executes RDMA WRITEs as memmoves between
registered host memory, reclaims send-queue slots only when a signalled completion is polled,
and refuses posts beyond the send-queue depth, as a NIC does), through the real TCP bootstrap
handshake. Where pyverbs can be imported from the dpkg-extracted tree in .deps/pyverbs (see
docs/ibverbs.md), the conversion to real pyverbs objects and the zero-device error are checked
against the real library in a subprocess.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
import types
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_transfer.backends import _ibverbs_plan as plan
from weight_transfer.backends.base import (
    ConfigurationError,
    PeerLostError,
    RegionDescriptor,
    RegionRole,
    TransportConfig,
    TransportError,
    TransportTimeoutError,
    TransportUnavailableError,
    WriteOp,
)

REPO = Path(__file__).resolve().parents[2]
DEPS = REPO / ".deps" / "pyverbs"
PYVERBS_SITE = DEPS / "usr" / "lib" / "python3" / "dist-packages"


# ---------------------------------------------------------------------------------------------
# Options and QP attributes.
# ---------------------------------------------------------------------------------------------


def test_parse_options_defaults_and_every_key() -> None:
    assert plan.parse_options(()) == plan.IbverbsOptions()
    opts = plan.parse_options(
        [
            ("device", "mlx5_3"),
            ("port", "2"),
            ("gid_index", "3"),
            ("num_qps", "8"),
            ("max_send_wr", "128"),
            ("signal_every", "16"),
            ("max_wr_bytes", "0x10000"),
            ("mtu", "4096"),
            ("timeout", "18"),
            ("retry_cnt", "5"),
            ("rnr_retry", "6"),
            ("min_rnr_timer", "10"),
            ("max_rd_atomic", "2"),
            ("max_dest_rd_atomic", "4"),
            ("sl", "3"),
            ("traffic_class", "106"),
            ("hop_limit", "32"),
            ("gpu_registration", "peermem"),
            ("bootstrap_port", "18515"),
            ("advertise_host", "10.0.0.7"),
        ]
    )
    assert (opts.device, opts.port, opts.gid_index, opts.num_qps_per_peer) == ("mlx5_3", 2, 3, 8)
    assert (opts.max_send_wr, opts.signal_every, opts.max_wr_bytes) == (128, 16, 65536)
    assert (opts.mtu_bytes, opts.timeout_exp, opts.retry_cnt, opts.rnr_retry) == (4096, 18, 5, 6)
    assert (opts.service_level, opts.traffic_class, opts.hop_limit) == (3, 106, 32)
    assert opts.gpu_registration is plan.GpuRegistration.PEERMEM
    assert (opts.bootstrap_port, opts.advertise_host) == (18515, "10.0.0.7")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ([("devices", "mlx5_0")], "unknown ibverbs option 'devices'"),
        ([("port", "one")], "port='one' is not an integer"),
        ([("port", "0")], "port=0"),
        ([("signal_every", "64"), ("max_send_wr", "32")], "signal_every=64 must be <="),
        ([("mtu", "1500")], "mtu=1500"),
        ([("retry_cnt", "8")], "retry_cnt=8"),
        ([("gpu_registration", "magic")], "gpu_registration='magic'"),
        ([("gid_index", "-1")], "gid_index=-1"),
        ([("device", "")], "device must not be empty"),
    ],
)
def test_parse_options_rejects_bad_values(options: list[tuple[str, str]], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        plan.parse_options(options)


def test_init_transition_sets_port_and_remote_write_access() -> None:
    t = plan.init_transition(2)
    assert t.state == "INIT"
    assert t.mask == ("IBV_QP_STATE", "IBV_QP_PKEY_INDEX", "IBV_QP_PORT", "IBV_QP_ACCESS_FLAGS")
    assert t.value("port_num") == 2 and t.value("pkey_index") == 0
    assert t.value("qp_access_flags") == ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE")


def _av(**kw: Any) -> plan.AddressVector:
    base = dict(
        opts=plan.IbverbsOptions(),
        port_num=1,
        link_layer=plan.LINK_LAYER_ETHERNET,
        sgid_index=3,
        remote_lid=0,
        remote_gid=bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 2]),
    )
    base.update(kw)
    return plan.address_vector(**base)  # type: ignore[arg-type]


def test_rtr_and_rts_transitions_carry_every_required_attribute() -> None:
    opts = plan.IbverbsOptions(max_dest_rd_atomic=4, min_rnr_timer=10, timeout_exp=18)
    av = _av()
    rtr = plan.rtr_transition(
        opts=opts, path_mtu_bytes=4096, remote_qpn=0x1234, remote_psn=77, av=av
    )
    assert rtr.state == "RTR"
    assert set(rtr.mask) == {
        "IBV_QP_STATE", "IBV_QP_AV", "IBV_QP_PATH_MTU", "IBV_QP_DEST_QPN", "IBV_QP_RQ_PSN",
        "IBV_QP_MAX_DEST_RD_ATOMIC", "IBV_QP_MIN_RNR_TIMER",
    }  # fmt: skip
    assert rtr.value("path_mtu") == 5 and rtr.value("dest_qp_num") == 0x1234
    assert rtr.value("rq_psn") == 77 and rtr.value("max_dest_rd_atomic") == 4
    assert rtr.value("min_rnr_timer") == 10 and rtr.value("ah_attr") is av
    rts = plan.rts_transition(opts=opts, local_psn=99)
    assert set(rts.mask) == {
        "IBV_QP_STATE", "IBV_QP_TIMEOUT", "IBV_QP_RETRY_CNT", "IBV_QP_RNR_RETRY",
        "IBV_QP_SQ_PSN", "IBV_QP_MAX_QP_RD_ATOMIC",
    }  # fmt: skip
    assert rts.value("sq_psn") == 99 and rts.value("timeout") == 18
    assert rts.value("retry_cnt") == 7 and rts.value("rnr_retry") == 7
    with pytest.raises(ValueError, match="24-bit"):
        plan.rts_transition(opts=opts, local_psn=1 << 24)
    with pytest.raises(ValueError, match="remote QP number"):
        plan.rtr_transition(opts=opts, path_mtu_bytes=1024, remote_qpn=0, remote_psn=1, av=av)
    assert all(0 <= plan.random_psn() < (1 << 24) for _ in range(100))


def test_address_vector_roce_uses_grh_ib_uses_dlid() -> None:
    roce = _av()
    assert roce.is_global and roce.dlid == 0 and roce.sgid_index == 3
    ib = _av(link_layer=plan.LINK_LAYER_INFINIBAND, remote_lid=17)
    assert not ib.is_global and ib.dlid == 17
    forced = _av(
        link_layer=plan.LINK_LAYER_INFINIBAND, remote_lid=17, opts=plan.IbverbsOptions(gid_index=0)
    )
    assert forced.is_global and forced.dlid == 17
    with pytest.raises(ConfigurationError, match="zero GID"):
        _av(remote_gid=bytes(16))


def test_path_mtu() -> None:
    assert plan.path_mtu(4096, 1024, None) == 1024
    assert plan.path_mtu(4096, 4096, 2048) == 2048
    with pytest.raises(ConfigurationError, match="exceeds the active MTU"):
        plan.path_mtu(4096, 1024, 2048)


# ---------------------------------------------------------------------------------------------
# GID and NIC selection.
# ---------------------------------------------------------------------------------------------

V4 = bytes(10) + b"\xff\xff" + bytes([192, 168, 1, 5])
LINK_LOCAL = bytes.fromhex("fe800000000000000202c9fffe000001")
GLOBAL6 = bytes.fromhex("20010db8000000000000000000000042")


def test_gid_text_round_trips_in_pyverbs_and_ipv6_forms() -> None:
    text = "0000:0000:0000:0000:0000:ffff:c0a8:0105"
    assert plan.gid_from_string(text) == V4
    assert plan.gid_from_string("::ffff:192.168.1.5") == V4
    assert plan.gid_to_string(V4) == "::ffff:192.168.1.5"
    assert plan.gid_ipv4(V4) == "192.168.1.5" and plan.gid_ipv4(LINK_LOCAL) is None
    with pytest.raises(ValueError, match="not a GID"):
        plan.gid_from_string("fe80:1")


def test_select_gid_prefers_roce_v2_ipv4_then_configured_ipv6() -> None:
    v1, v2 = plan.GidType.IB_ROCE_V1, plan.GidType.ROCE_V2
    eth = plan.LINK_LAYER_ETHERNET
    table = [(0, v1, LINK_LOCAL), (1, v2, LINK_LOCAL), (2, v1, V4), (3, v2, V4), (4, v2, GLOBAL6)]
    assert plan.select_gid(table, link_layer=eth) == 3
    assert plan.select_gid([t for t in table if t[0] != 3], link_layer=eth) == 4
    assert plan.select_gid(table[:3], link_layer=eth) == 1
    assert plan.select_gid([(0, v1, LINK_LOCAL), (5, v1, bytes(16))], link_layer=eth) == 0
    assert plan.select_gid(table, link_layer=eth, forced_index=2) == 2
    with pytest.raises(ConfigurationError, match="gid_index=7 is not a populated"):
        plan.select_gid(table, link_layer=eth, forced_index=7)
    with pytest.raises(ConfigurationError, match="GID table is empty"):
        plan.select_gid([(0, v2, bytes(16))], link_layer=eth)
    ib = [(0, v1, LINK_LOCAL), (1, v1, GLOBAL6)]
    assert plan.select_gid(ib, link_layer=plan.LINK_LAYER_INFINIBAND) == 0


def _pci_function(root: Path, chain: list[str], numa: int) -> Path:
    path = root / "devices" / Path(*chain)
    path.mkdir(parents=True, exist_ok=True)
    (path / "numa_node").write_text(f"{numa}\n")
    return path


def _fake_sysfs(root: Path) -> None:
    """Two root complexes; GPU 0000:1a:00.0 under switch 0000:18 with mlx5_1; mlx5_0 under the
    same root complex but another switch; mlx5_2 on the other root complex (NUMA 1)."""
    sw_a = ["pci0000:16", "0000:16:02.0", "0000:17:00.0"]
    sw_b = ["pci0000:16", "0000:16:03.0", "0000:20:00.0"]
    gpu = _pci_function(root, [*sw_a, "0000:18:08.0", "0000:1a:00.0"], 0)
    nic1 = _pci_function(root, [*sw_a, "0000:18:10.0", "0000:1c:00.0"], 0)
    nic0 = _pci_function(root, [*sw_b, "0000:21:00.0", "0000:22:00.0"], 0)
    nic2 = _pci_function(root, ["pci0000:80", "0000:80:01.0", "0000:81:00.0"], 1)
    for name, target in (("mlx5_0", nic0), ("mlx5_1", nic1), ("mlx5_2", nic2)):
        d = root / "class" / "infiniband" / name
        d.mkdir(parents=True)
        (d / "device").symlink_to(target)
    bus = root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    (bus / "0000:1a:00.0").symlink_to(gpu)
    (bus / "0000:81:00.0").symlink_to(nic2)


def test_nic_selection_by_pcie_distance_on_a_fake_sysfs(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    nics = plan.discover_nics(tmp_path, "00000000:1A:00.0")  # CUDA spells it this way
    by_name = {n.name: n for n in nics}
    assert sorted(by_name) == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert by_name["mlx5_1"].hops == 4  # up to the shared switch port and down again
    assert by_name["mlx5_0"].hops == 8
    assert by_name["mlx5_2"].hops is None and by_name["mlx5_2"].numa_node == 1
    assert plan.select_nic(nics).name == "mlx5_1"
    assert plan.select_nic(nics, usable=["mlx5_0", "mlx5_2"]).name == "mlx5_0"
    assert plan.gpu_numa_node(tmp_path, "0000:1a:00.0") == 0
    # A GPU on the second root complex: no common root for mlx5_0/1, NUMA decides.
    far = plan.discover_nics(tmp_path, "0000:81:00.0")
    assert plan.select_nic(far, gpu_numa=1, usable=["mlx5_0", "mlx5_2"]).name == "mlx5_2"
    with pytest.raises(ConfigurationError, match="no usable RDMA device"):
        plan.select_nic(nics, usable=[])
    assert plan.discover_nics(tmp_path / "nothing") == []


def test_nic_selection_without_gpu_falls_back_to_numa_then_name(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    nics = plan.discover_nics(tmp_path, None)
    assert all(n.hops is None for n in nics)
    assert plan.select_nic(nics).name == "mlx5_0"
    assert plan.select_nic(nics, gpu_numa=1).name == "mlx5_2"
    assert plan.normalize_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    with pytest.raises(ValueError, match="not a PCI bus id"):
        plan.normalize_bus_id("garbage")


# ---------------------------------------------------------------------------------------------
# Wire formats.
# ---------------------------------------------------------------------------------------------


def test_remote_key_payload_round_trip_and_rejects() -> None:
    key = plan.RemoteKey(rkey=0xDEADBEEF, address=0x7F00_1234_5000, length=1 << 33)
    assert plan.RemoteKey.from_payload(key.to_payload()) == key
    import msgpack

    for bad in (
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb([1 << 32, 0, 1]),
        msgpack.packb([1, -1, 1]),
    ):
        with pytest.raises(ValueError, match="payload"):
            plan.RemoteKey.from_payload(bad)


def _endpoint(**kw: Any) -> plan.Endpoint:
    fields = dict(
        host="10.1.2.3", port=18515, cookie=bytes(range(16)), device="mlx5_1", ib_port=1,
        link_layer=plan.LINK_LAYER_ETHERNET, lid=0, gid=V4, gid_index=3, active_mtu=4096,
    )  # fmt: skip
    fields.update(kw)
    return plan.Endpoint(**fields)  # type: ignore[arg-type]


def test_endpoint_round_trip_and_schema_check() -> None:
    import msgpack

    ep = _endpoint()
    assert plan.Endpoint.from_bytes(ep.to_bytes()) == ep
    obj = msgpack.unpackb(ep.to_bytes())
    for key, value, match in (
        ("cookie", b"short", "cookie"),
        ("mtu", 1500, "mtu"),
        ("port", 0, "port"),
        ("gid", b"x" * 15, "gid"),
        ("v", 2, "version"),
    ):
        broken = dict(obj, **{key: value})
        with pytest.raises(ValueError, match=match):
            plan.Endpoint.from_bytes(msgpack.packb(broken))
    missing = {k: v for k, v in obj.items() if k != "lid"}
    with pytest.raises(ValueError, match="fields"):
        plan.Endpoint.from_bytes(msgpack.packb(missing))
    with pytest.raises(ValueError, match="not valid msgpack"):
        plan.Endpoint.from_bytes(b"\xc1\xc1")


def test_handshake_messages_round_trip_and_reject() -> None:
    req = plan.ConnectRequest(
        cookie=b"c" * 16, name="w0", link_layer=plan.LINK_LAYER_INFINIBAND, lid=5, gid=LINK_LOCAL,
        active_mtu=2048, qpns=(11, 12), psns=(0, (1 << 24) - 1),
    )  # fmt: skip
    assert plan.ConnectRequest.from_bytes(req.to_bytes()) == req
    bad = dataclasses.replace(req, qpns=(11,))
    with pytest.raises(ValueError, match="invalid fields"):
        plan.ConnectRequest.from_bytes(bad.to_bytes())
    rep = plan.ConnectReply(error="", qpns=(21, 22), psns=(3, 4))
    assert plan.ConnectReply.from_bytes(rep.to_bytes()) == rep
    assert plan.ConnectReply.from_bytes(plan.ConnectReply(error="no").to_bytes()).error == "no"
    with pytest.raises(ValueError, match="reply"):
        plan.ConnectReply.from_bytes(req.to_bytes())


# ---------------------------------------------------------------------------------------------
# Work requests, signalling, credits, completion statuses.
# ---------------------------------------------------------------------------------------------


def test_split_writes_cuts_large_writes_into_contiguous_pieces() -> None:
    spans = [
        plan.WriteSpan(local_addr=1000, lkey=1, remote_addr=50_000, rkey=9, length=10),
        plan.WriteSpan(local_addr=5000, lkey=2, remote_addr=90_000, rkey=8, length=25),
    ]
    wrs = plan.split_writes(spans, 10)
    assert [(w.local_addr, w.remote_addr, w.length, w.lkey, w.rkey) for w in wrs] == [
        (1000, 50_000, 10, 1, 9),
        (5000, 90_000, 10, 2, 8),
        (5010, 90_010, 10, 2, 8),
        (5020, 90_020, 5, 2, 8),
    ]


def test_assign_round_robin_continues_across_batches() -> None:
    wrs = [plan.WorkRequest(i, 0, 1, 0, 0) for i in range(7)]
    lanes, nxt = plan.assign_round_robin(wrs, 3, 2)
    assert [[w.local_addr for w in lane] for lane in lanes] == [[1, 4], [2, 5], [0, 3, 6]]
    assert nxt == 0
    _, nxt = plan.assign_round_robin(wrs[:2], 3, nxt)
    assert nxt == 2


def test_signal_flags_pattern() -> None:
    assert plan.signal_flags(10, 0, 4) == [False, False, False, True] * 2 + [False, True]
    assert plan.signal_flags(1, 0, 4) == [True]
    assert plan.signal_flags(3, 2, 4) == [False, True, True]
    assert plan.signal_flags(3, 0, 1) == [True, True, True]


@settings(max_examples=200, deadline=None)
@given(
    chains=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    every=st.integers(1, 64),
)
def test_signalling_and_credits_never_overflow_the_send_queue(
    chains: list[int], every: int
) -> None:
    """Simulate one QP: post chains as credits allow, complete signalled requests in order."""
    depth = max(every, 64)
    ledger = plan.CreditLedger(1, depth)
    posted: deque[tuple[int, bool]] = deque()
    ids = itertools.count()
    for chain in chains:
        left = chain
        while left:
            n = min(left, ledger.available(0))
            if n == 0:  # the NIC completes the oldest signalled request
                while True:
                    wr_id, sig = posted.popleft()
                    if sig:
                        break
                ledger.on_completion(0, wr_id)
                continue
            flags = plan.signal_flags(n, ledger.unsignaled(0), every)
            assert flags[-1]  # every chain ends signalled
            run = 0
            for f in flags:
                run = 0 if f else run + 1
                assert run < every
            batch = [next(ids) for _ in range(n)]
            ledger.on_post(0, batch, flags)
            posted.extend(zip(batch, flags, strict=True))
            assert ledger.outstanding(0) == len(posted) <= depth
            left -= n
    while posted:
        wr_id, sig = posted.popleft()
        if sig:
            ledger.on_completion(0, wr_id)
    assert ledger.outstanding(0) == 0


def test_credit_ledger_refuses_posting_beyond_depth() -> None:
    ledger = plan.CreditLedger(2, 4)
    ledger.on_post(1, [1, 2, 3], [False, False, True])
    assert ledger.available(1) == 1 and ledger.available(0) == 4
    with pytest.raises(AssertionError, match="send-queue depth"):
        ledger.on_post(1, [4, 5], [False, True])
    assert ledger.on_completion(1, 3) == 3 and ledger.available(1) == 4
    with pytest.raises(KeyError):
        ledger.on_completion(1, 2)


def test_wr_id_encodes_the_batch() -> None:
    wr_id = plan.make_wr_id(0x1234, 0xFFFF_FFFF)
    assert wr_id < (1 << 64) and plan.wr_id_handle(wr_id) == 0x1234


def test_wc_status_decoding_names_the_peer() -> None:
    err = plan.decode_wc_status(12, peer="engine-3", vendor_err=0x81, qp_num=77)
    assert isinstance(err, PeerLostError)
    assert "engine-3" in str(err) and "IBV_WC_RETRY_EXC_ERR" in str(err) and "0x81" in str(err)
    assert isinstance(plan.decode_wc_status(13, peer="p"), PeerLostError)
    access = plan.decode_wc_status(10, peer="engine-1")
    assert type(access) is TransportError and "REM_ACCESS_ERR" in str(access)
    assert "rkey" in str(access)
    assert "unknown status 99" in str(plan.decode_wc_status(99, peer="p"))
    with pytest.raises(ValueError, match="not an error"):
        plan.decode_wc_status(0, peer="p")


# ---------------------------------------------------------------------------------------------
# The bootstrap side channel.
# ---------------------------------------------------------------------------------------------


def test_bootstrap_server_round_trip_and_bad_client() -> None:
    from weight_transfer.backends.ibverbs import BootstrapServer, bootstrap_request

    seen: list[bytes] = []

    def handler(data: bytes) -> bytes:
        seen.append(data)
        return data[::-1]

    server = BootstrapServer("127.0.0.1", 0, handler, timeout_s=2.0)
    try:
        # A client that connects and sends garbage must not stop the listener.
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
            s.sendall(b"\xff\xff\xff\xff")
        assert bootstrap_request("127.0.0.1", server.port, b"abc", timeout_s=5) == b"cba"
        assert seen == [b"abc"]
    finally:
        server.close()
    assert not server._thread.is_alive()


def test_bootstrap_request_times_out_on_a_silent_listener() -> None:
    from weight_transfer.backends.ibverbs import bootstrap_request

    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            bootstrap_request("127.0.0.1", port, b"hello", timeout_s=0.5)
        assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------------------------
# A simulated device, to run the transport end to end.
# ---------------------------------------------------------------------------------------------


class Fabric:
    """Shared by the fake devices of one test: QPs by number, MRs by rkey."""

    def __init__(self) -> None:
        self.qpns = itertools.count(0x100)
        self.keys = itertools.count(0x1000)
        self.qps: dict[int, FakeQP] = {}
        self.mrs: dict[int, tuple[int, int]] = {}  # key -> (address, length)
        self.dead_qpns: set[int] = set()
        self.wrs_per_poll = 5
        self.max_outstanding_seen = 0
        self.lock = threading.Lock()


@dataclasses.dataclass(eq=False)
class FakeCQ:
    entries: deque[Any] = dataclasses.field(default_factory=deque)
    qps: list[FakeQP] = dataclasses.field(default_factory=list)
    closed: bool = False
    log: list[str] | None = None

    def close(self) -> None:
        self.closed = True
        if self.log is not None:
            self.log.append("cq")


@dataclasses.dataclass(eq=False)
class FakeQP:
    fabric: Fabric
    qpn: int
    cq: FakeCQ
    max_send_wr: int
    state: str = "RESET"
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    queue: deque[tuple[int, plan.WorkRequest, bool]] = dataclasses.field(default_factory=deque)
    in_flight: deque[tuple[int, bool]] = dataclasses.field(default_factory=deque)
    failed: bool = False
    log: list[str] | None = None

    def close(self) -> None:
        self.fabric.qps.pop(self.qpn, None)
        self.state = "DESTROYED"
        if self.log is not None:
            self.log.append("qp")


class FakeDevice:
    """Implements the methods IbverbsTransport calls on PyverbsDevice, on host memory."""

    def __init__(self, fabric: Fabric, name: str = "fake_0", max_qp_wr: int = 1 << 15) -> None:
        self.fabric = fabric
        self.info = _port_info(name, max_qp_wr)
        self.log: list[str] = []
        self.closed = False

    def create_cq(self, depth: int) -> FakeCQ:
        return FakeCQ(log=self.log)

    def create_qp(self, cq: FakeCQ, max_send_wr: int) -> FakeQP:
        with self.fabric.lock:
            qp = FakeQP(self.fabric, next(self.fabric.qpns), cq, max_send_wr, log=self.log)
            self.fabric.qps[qp.qpn] = qp
        cq.qps.append(qp)
        return qp

    @staticmethod
    def qp_num(qp: FakeQP) -> int:
        return qp.qpn

    def modify_qp(self, qp: FakeQP, t: plan.QpTransition) -> None:
        order = {"RESET": "INIT", "INIT": "RTR", "RTR": "RTS"}
        assert order.get(qp.state) == t.state, f"bad transition {qp.state} -> {t.state}"
        assert t.mask[0] == "IBV_QP_STATE"
        qp.state = t.state
        qp.attrs.update(dict(t.values))

    def post_chain(self, qp: FakeQP, chain: list[tuple[int, plan.WorkRequest, bool]]) -> None:
        if qp.state != "RTS":
            raise OSError("EINVAL: QP not in RTS")
        if len(qp.in_flight) + len(chain) > qp.max_send_wr:
            raise OSError("ENOMEM: send queue full")
        for item in chain:
            qp.queue.append(item)
            qp.in_flight.append((item[0], item[2]))
        self.fabric.max_outstanding_seen = max(self.fabric.max_outstanding_seen, len(qp.in_flight))

    def _execute(self, qp: FakeQP, wr_id: int, wr: plan.WorkRequest, signaled: bool) -> Any:
        def wc(status: int) -> Any:
            return types.SimpleNamespace(wr_id=wr_id, status=status, vendor_err=0, qp_num=qp.qpn)

        if qp.failed:
            return wc(plan.WC_WR_FLUSH_ERR)
        dest = qp.attrs.get("dest_qp_num")
        remote = self.fabric.qps.get(dest) if dest not in self.fabric.dead_qpns else None
        if (
            remote is None
            or remote.state not in ("RTR", "RTS")
            or remote.attrs.get("dest_qp_num") != qp.qpn
        ):
            qp.failed = True
            return wc(12)  # RETRY_EXC_ERR: nobody acknowledges
        local = self.fabric.mrs.get(wr.lkey)
        target = self.fabric.mrs.get(wr.rkey)
        if local is None or not (
            local[0] <= wr.local_addr and wr.local_addr + wr.length <= sum(local)
        ):
            qp.failed = True
            return wc(4)  # LOC_PROT_ERR
        if target is None or not (
            target[0] <= wr.remote_addr and wr.remote_addr + wr.length <= sum(target)
        ):
            qp.failed = True
            return wc(10)  # REM_ACCESS_ERR
        ctypes.memmove(wr.remote_addr, wr.local_addr, wr.length)
        return wc(0) if signaled else None

    def poll(self, cq: FakeCQ, max_entries: int) -> list[Any]:
        budget = self.fabric.wrs_per_poll
        for qp in cq.qps:
            while qp.queue and budget > 0:
                wr_id, wr, signaled = qp.queue.popleft()
                budget -= 1
                entry = self._execute(qp, wr_id, wr, signaled)
                if entry is not None:
                    cq.entries.append(entry)
                    # A polled completion frees its slot and every earlier one on the QP.
                    while qp.in_flight:
                        done_id, _ = qp.in_flight.popleft()
                        if done_id == wr_id:
                            break
        out = []
        while cq.entries and len(out) < max_entries:
            out.append(cq.entries.popleft())
        return out

    def register_host(self, address: int, length: int) -> Any:
        from weight_transfer.backends.ibverbs import MemoryRegistration

        key = next(self.fabric.keys)
        self.fabric.mrs[key] = (address, length)
        return MemoryRegistration(key, key, address, length, "host", handle=key)

    def register_cuda(self, *args: Any) -> Any:
        raise TransportError("fake device: no GPU")

    def deregister(self, reg: Any) -> None:
        self.fabric.mrs.pop(reg.lkey, None)
        self.log.append("mr")

    def close(self) -> None:
        self.closed = True
        self.log.append("pd+context")


def _port_info(name: str, max_qp_wr: int) -> Any:
    from weight_transfer.backends.ibverbs import PortInfo

    return PortInfo(
        device=name, port=1, link_layer=plan.LINK_LAYER_ETHERNET, lid=0, gid=V4, gid_index=3,
        active_mtu=4096, max_qp_wr=max_qp_wr, max_msg_bytes=1 << 31, max_cqe=1 << 20,
    )  # fmt: skip


def _transport(fabric: Fabric, *options: tuple[str, str], timeout_s: float = 10.0) -> Any:
    from weight_transfer.backends.ibverbs import IbverbsTransport

    config = TransportConfig(name="ibverbs", options=tuple(options), connect_timeout_s=timeout_s)
    return IbverbsTransport(config, device=FakeDevice(fabric))


def _seeded(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_transport_end_to_end_on_a_simulated_device() -> None:
    fabric = Fabric()
    opts = [("num_qps", "3"), ("max_send_wr", "8"), ("signal_every", "3"), ("max_wr_bytes", "4096")]
    writer = _transport(fabric, *opts)
    target = _transport(fabric)
    try:
        src_tensor = _seeded(200_000, seed=1).view(torch.float16)
        dst_tensor = _seeded(300_000, seed=2)
        before = dst_tensor.clone()
        src = writer.register(src_tensor, role=RegionRole.SOURCE)
        dst = target.register(dst_tensor, role=RegionRole.TARGET)
        assert dst.descriptor is not None and dst.descriptor.backend == "ibverbs"
        desc = RegionDescriptor.from_bytes(dst.descriptor.to_bytes())  # as the control plane does
        writer.connect("engine-0", target.endpoint())
        # Both sides' QPs are paired and ready.
        state = writer._peer_state["engine-0"]
        assert len(state.qps) == 3 and all(q.state == "RTS" for q in state.qps)
        paired = {q.attrs["dest_qp_num"] for q in state.qps}
        accepted = target._accepted[0][2]
        assert paired == {q.qpn for q in accepted} and all(q.state == "RTS" for q in accepted)
        assert {q.attrs["dest_qp_num"] for q in accepted} == {q.qpn for q in state.qps}
        assert all(
            q.attrs["rq_psn"] == p.attrs["sq_psn"]
            for q in accepted
            for p in state.qps
            if q.attrs["dest_qp_num"] == p.qpn
        )

        ops = [
            WriteOp(src, 0, desc, 1000, 150_000),  # split into 37 work requests
            WriteOp(src, 150_000, desc, 200_000, 50_000),
            WriteOp(src, 7, desc, 260_001, 13),
        ]
        h1 = writer.post_writes("engine-0", ops[:2])
        h2 = writer.post_writes("engine-0", ops[2:])
        writer.wait(h1, timeout_s=10)
        writer.wait(h2, timeout_s=10)
        raw = src_tensor.view(torch.uint8)
        expected = before.clone()
        for op in ops:
            expected[op.target_offset : op.target_offset + op.nbytes] = raw[
                op.source_offset : op.source_offset + op.nbytes
            ]
        assert torch.equal(dst_tensor, expected)
        assert fabric.max_outstanding_seen <= 8
        assert all(state.ledger.outstanding(i) == 0 for i in range(3))
        assert state.batches == {}
    finally:
        writer.close()
        target.close()


def test_peer_loss_surfaces_as_peer_lost_error_naming_the_peer() -> None:
    fabric = Fabric()
    writer = _transport(fabric, ("num_qps", "2"))
    target = _transport(fabric)
    try:
        src = writer.register(_seeded(4096, 3), role=RegionRole.SOURCE)
        dst = target.register(_seeded(4096, 4), role=RegionRole.TARGET)
        writer.connect("engine-7", target.endpoint())
        assert dst.descriptor is not None
        fabric.dead_qpns.update(q.qpn for q in target._accepted[0][2])
        handle = writer.post_writes("engine-7", [WriteOp(src, 0, dst.descriptor, 0, 4096)])
        with pytest.raises(PeerLostError, match="engine-7.*RETRY_EXC_ERR"):
            writer.wait(handle, timeout_s=5)
        with pytest.raises(PeerLostError, match="engine-7"):
            writer.post_writes("engine-7", [WriteOp(src, 0, dst.descriptor, 0, 16)])
    finally:
        writer.close()
        target.close()


def test_bad_rkey_is_a_transport_error_and_fails_batches_in_flight() -> None:
    fabric = Fabric()
    writer = _transport(fabric, ("num_qps", "1"), ("max_wr_bytes", "1024"))
    target = _transport(fabric)
    try:
        src = writer.register(_seeded(8192, 5), role=RegionRole.SOURCE)
        dst = target.register(_seeded(8192, 6), role=RegionRole.TARGET)
        writer.connect("engine-1", target.endpoint())
        good = dst.descriptor
        assert good is not None
        forged = plan.RemoteKey(rkey=0xBAD, address=dst.address, length=8192).to_payload()
        bad = RegionDescriptor(backend="ibverbs", kind=good.kind, nbytes=8192, payload=forged)
        h_bad = writer.post_writes("engine-1", [WriteOp(src, 0, bad, 0, 4096)])
        h_good = writer.post_writes("engine-1", [WriteOp(src, 0, good, 0, 4096)])
        with pytest.raises(TransportError, match="engine-1.*REM_ACCESS_ERR"):
            writer.wait(h_bad, timeout_s=5)
        with pytest.raises(TransportError, match="REM_ACCESS_ERR"):
            writer.wait(h_good, timeout_s=5)  # flushed behind the failure, same root cause
    finally:
        writer.close()
        target.close()


def test_a_failed_batch_settles_only_once_its_other_qps_are_drained() -> None:
    """A completion error on one QP fails the peer's batches, but the requests already posted
    on the peer's other QPs still execute, reading their source memory (only the failed QP is
    flushed). The failed batch used to be dropped at once (and nothing reaped the other QPs);
    now it settles (`WriteHandle.settled`, the Transport contract) only once the last request
    of every chain it posted completed, and then nothing of it is left on any QP."""
    fabric = Fabric()
    fabric.wrs_per_poll = 2  # the simulated HCA executes two requests per CQ poll
    writer = _transport(fabric, ("num_qps", "2"), ("max_wr_bytes", "1024"), ("signal_every", "4"))
    target = _transport(fabric)
    try:
        src = writer.register(_seeded(32 * 1024, 9), role=RegionRole.SOURCE)
        dst_tensor = _seeded(32 * 1024, 10)
        dst = target.register(dst_tensor, role=RegionRole.TARGET)
        assert dst.descriptor is not None
        writer.connect("engine-2", target.endpoint())
        state = writer._peer_state["engine-2"]
        # QP 0's remote end is gone (no acknowledgement: RETRY_EXC_ERR); QP 1's works.
        fabric.dead_qpns.add(state.qps[0].attrs["dest_qp_num"])
        handle = writer.post_writes("engine-2", [WriteOp(src, 0, dst.descriptor, 0, 32 * 1024)])
        with pytest.raises(PeerLostError, match="engine-2.*RETRY_EXC_ERR"):
            writer.wait(handle, timeout_s=5)
        assert state.qps[1].queue, "QP 1 had nothing left to execute: the test proves nothing"
        assert not handle.settled
        assert writer.quiesce(handle, timeout_s=5) and handle.settled
        assert all(not qp.queue for qp in state.qps)  # nothing of the batch can run any more
        assert state.batches == {}
        assert all(state.ledger.outstanding(i) == 0 for i in range(2))
    finally:
        writer.close()
        target.close()


def test_connect_rejects_wrong_cookie_and_times_out_on_silent_peer() -> None:
    fabric = Fabric()
    writer = _transport(fabric, timeout_s=0.5)
    target = _transport(fabric)
    try:
        ep = plan.Endpoint.from_bytes(target.endpoint())
        forged = dataclasses.replace(ep, cookie=b"\x00" * 16).to_bytes()
        with pytest.raises(PeerLostError, match="engine-2.*refused.*wrong cookie"):
            writer.connect("engine-2", forged)
        with socket.create_server(("127.0.0.1", 0)) as silent:
            quiet = dataclasses.replace(ep, port=silent.getsockname()[1]).to_bytes()
            start = time.monotonic()
            with pytest.raises(TransportTimeoutError, match="engine-2"):
                writer.connect("engine-2", quiet)
            assert time.monotonic() - start < 5
        with pytest.raises(ValueError, match="endpoint of peer 'x' is invalid"):
            writer.connect("x", b"junk")
        assert writer.peers == []
        # The failed attempts left no QP behind on either side.
        assert fabric.qps == {}
    finally:
        writer.close()
        target.close()


def test_close_releases_qps_then_mrs_then_cqs_then_pd_and_context() -> None:
    fabric = Fabric()
    writer = _transport(fabric, ("num_qps", "2"))
    target = _transport(fabric)
    writer.register(_seeded(64, 7), role=RegionRole.SOURCE)
    target.register(_seeded(64, 8), role=RegionRole.TARGET)
    writer.connect("e", target.endpoint())
    dev = writer._dev
    writer.close()
    target.close()
    log = dev.log
    assert log == ["qp", "qp", "mr", "cq", "cq", "pd+context"]
    assert fabric.qps == {} and fabric.mrs == {}
    assert not writer._server and not target._server
    writer.close()  # idempotent


def test_construction_failure_leaves_nothing_open() -> None:
    from weight_transfer.backends.ibverbs import IbverbsTransport

    fabric = Fabric()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        dev = FakeDevice(fabric)
        config = TransportConfig(name="ibverbs", options=(("bootstrap_port", str(port)),))
        with pytest.raises(OSError):
            IbverbsTransport(config, device=dev)
    assert dev.closed and dev.log == ["cq", "pd+context"]


# ---------------------------------------------------------------------------------------------
# Zero devices, pyverbs missing, doctor.
# ---------------------------------------------------------------------------------------------


def test_missing_pyverbs_raises_unavailable_with_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weight_transfer.backends.base import create_transport
    from weight_transfer.backends.ibverbs import doctor_info

    monkeypatch.setitem(sys.modules, "pyverbs", None)  # makes `import pyverbs...` fail
    with pytest.raises(TransportUnavailableError, match="python3-pyverbs.*cython<3.1"):
        create_transport(TransportConfig(name="ibverbs"))
    info = doctor_info()
    assert info["pyverbs"] is False and info["num_devices"] == 0 and "pyverbs" in info["error"]


def _fake_pyverbs(monkeypatch: pytest.MonkeyPatch, get_device_list: Any) -> None:
    class PyverbsError(Exception):
        pass

    class PyverbsRDMAError(PyverbsError):
        pass

    mods = {name: types.ModuleType(name) for name in (
        "pyverbs", "pyverbs.addr", "pyverbs.cq", "pyverbs.device", "pyverbs.enums", "pyverbs.mr",
        "pyverbs.pd", "pyverbs.pyverbs_error", "pyverbs.qp", "pyverbs.wr",
    )}  # fmt: skip
    mods["pyverbs.pyverbs_error"].PyverbsError = PyverbsError  # type: ignore[attr-defined]
    mods["pyverbs.pyverbs_error"].PyverbsRDMAError = PyverbsRDMAError  # type: ignore[attr-defined]

    def opened(**kw: Any) -> None:
        raise AssertionError("no context may be opened when there is no device")

    mods["pyverbs.device"].get_device_list = lambda: get_device_list(PyverbsRDMAError)  # type: ignore[attr-defined]
    mods["pyverbs.device"].Context = opened  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
        if "." in name:
            setattr(mods["pyverbs"], name.split(".")[1], mod)


@pytest.mark.parametrize("kind", ["empty list", "NULL list"])
def test_zero_devices_raise_unavailable_and_open_nothing(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    from weight_transfer.backends.base import create_transport
    from weight_transfer.backends.ibverbs import NO_DEVICE_MESSAGE, doctor_info

    def listing(err: type[Exception]) -> list[Any]:
        if kind == "NULL list":  # what pyverbs 44 does when /sys/class/infiniband is absent
            raise err("Failed to get devices list")
        return []

    _fake_pyverbs(monkeypatch, listing)
    threads = threading.active_count()
    with pytest.raises(
        TransportUnavailableError, match=r"no RDMA device found \(ibv_get_device_list returned 0\)"
    ):
        create_transport(TransportConfig(name="ibverbs"))
    assert threading.active_count() == threads  # no bootstrap thread left behind
    info = doctor_info()
    assert (
        info["pyverbs"] is True and info["num_devices"] == 0 and info["error"] == NO_DEVICE_MESSAGE
    )


def _pyverbs_env() -> dict[str, str]:
    """The environment of a child that imports pyverbs: as is where the venv sees the system's
    (CI links Debian's python3-pyverbs into its venv), else the tree extracted into .deps."""
    env = dict(os.environ)
    if importlib.util.find_spec("pyverbs") is not None:
        return env
    libs = [str(DEPS / "usr" / "lib" / "x86_64-linux-gnu"), str(DEPS / "lib" / "x86_64-linux-gnu")]
    env["PYTHONPATH"] = os.pathsep.join([str(PYVERBS_SITE), str(REPO)])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return env


def _pyverbs_importable() -> bool:
    if importlib.util.find_spec("pyverbs") is None and not PYVERBS_SITE.is_dir():
        return False
    rc = subprocess.run(
        [sys.executable, "-c", "import pyverbs.device"], env=_pyverbs_env(), timeout=60,
        capture_output=True,
    ).returncode  # fmt: skip
    return rc == 0


requires_extracted_pyverbs = pytest.mark.skipif(
    not _pyverbs_importable(),
    reason="pyverbs neither importable nor extracted into .deps/pyverbs (docs/ibverbs.md, Install)",
)

_REAL_PYVERBS_SCRIPT = r"""
import threading
from weight_transfer.backends import _ibverbs_plan as plan
from weight_transfer.backends.base import (
    TransportConfig, TransportUnavailableError, create_transport,
)
from weight_transfer.backends.ibverbs import (
    build_send_chain, doctor_info, import_pyverbs, to_pyverbs_qp_attr,
)

pv = import_pyverbs()
e = pv.enums
# Our WC status table and MTU table agree with the library's enums.
for value, name in plan.WC_STATUS_NAMES.items():
    assert int(getattr(e, name)) == value, name
for nbytes, value in plan.MTU_ENUM_BY_BYTES.items():
    assert int(getattr(e, f"IBV_MTU_{nbytes}")) == value
# Plain transitions convert into real QPAttr objects with the right masks.
opts = plan.IbverbsOptions()
gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 9])
av = plan.address_vector(opts=opts, port_num=1, link_layer=plan.LINK_LAYER_ETHERNET,
                         sgid_index=3, remote_lid=0, remote_gid=gid)
attr, mask = to_pyverbs_qp_attr(pv, plan.rtr_transition(
    opts=opts, path_mtu_bytes=4096, remote_qpn=0x4242, remote_psn=1234, av=av))
assert mask == (e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
                | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
assert attr.qp_state == e.IBV_QPS_RTR and attr.path_mtu == e.IBV_MTU_4096
assert attr.dest_qp_num == 0x4242 and attr.rq_psn == 1234
assert attr.ah_attr.is_global == 1 and attr.ah_attr.sgid_index == 3
assert attr.ah_attr.dgid == "0000:0000:0000:0000:0000:ffff:0a00:0009", attr.ah_attr.dgid
attr, mask = to_pyverbs_qp_attr(pv, plan.init_transition(2))
assert attr.port_num == 2 and attr.qp_state == e.IBV_QPS_INIT
assert attr.qp_access_flags == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
attr, mask = to_pyverbs_qp_attr(pv, plan.rts_transition(opts=opts, local_psn=77))
assert attr.sq_psn == 77 and attr.retry_cnt == 7 and mask & e.IBV_QP_MAX_QP_RD_ATOMIC
chain = [(i, plan.WorkRequest(0x1000 + i, 5, 64, 0x9000 + i, 6), i == 2) for i in range(3)]
wrs = build_send_chain(pv, chain)
assert [w.wr_id for w in wrs] == [0, 1, 2]
assert [w.send_flags for w in wrs] == [0, 0, e.IBV_SEND_SIGNALED]
assert all(w.opcode == e.IBV_WR_RDMA_WRITE for w in wrs)
# Zero devices, for real.
try:
    create_transport(TransportConfig(name="ibverbs"))
except TransportUnavailableError as exc:
    assert "no RDMA device found (ibv_get_device_list returned 0)" in str(exc), exc
else:
    raise AssertionError("constructed an ibverbs transport without a device")
assert threading.active_count() == 1
info = doctor_info()
assert info["pyverbs"] and info["num_devices"] == 0, info
print("REAL-PYVERBS-OK")
"""


@requires_extracted_pyverbs
def test_against_real_pyverbs_zero_devices_and_object_conversion() -> None:
    if Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir()):
        pytest.skip("this host has an RDMA device; the conformance suite covers it")
    proc = subprocess.run(
        [sys.executable, "-c", _REAL_PYVERBS_SCRIPT], env=_pyverbs_env(), cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "REAL-PYVERBS-OK" in proc.stdout


# Soft-RoCE retries forever at retry_cnt 7 (rxe_comp.c); its queue pairs get 6, hardware's keep 7.


@pytest.mark.parametrize(
    ("vendor_id", "options", "programmed"),
    [
        (plan.RXE_VENDOR_ID, (), 6),
        (0x02C9, (), 7),  # Mellanox
        (plan.RXE_VENDOR_ID, (("retry_cnt", "3"),), 3),
    ],
)
def test_retry_count_programmed_into_queue_pairs_follows_the_device(
    vendor_id: int, options: tuple[tuple[str, str], ...], programmed: int
) -> None:
    import dataclasses as dc

    from weight_transfer.backends.ibverbs import IbverbsTransport

    fabric = Fabric()

    def device() -> FakeDevice:
        dev = FakeDevice(fabric)
        dev.info = dc.replace(dev.info, vendor_id=vendor_id)
        return dev

    config = TransportConfig(name="ibverbs", options=options, connect_timeout_s=10.0)
    writer = IbverbsTransport(config, device=device())
    target = IbverbsTransport(TransportConfig(name="ibverbs"), device=device())
    try:
        writer.connect("engine-0", target.endpoint())
        for qp in writer._peer_state["engine-0"].qps:
            assert qp.state == "RTS" and qp.attrs["retry_cnt"] == programmed
        default = 6 if vendor_id == plan.RXE_VENDOR_ID else 7  # the target set no options
        assert all(qp.attrs["retry_cnt"] == default for qp in target._accepted[0][2])
    finally:
        writer.close()
        target.close()
