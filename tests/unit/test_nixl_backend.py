"""NIXL backend specifics: payload codec (msgpack, never NIXL's pickle serializer), options
(UCX ones through NIXL's `engine_config`, not the process environment), segmenting, and reuse
of prepared descriptor lists across repeated batches. Cross-process writes live in
tests/conformance.
"""

from __future__ import annotations

import contextlib
import os
import sys

import msgpack
import pytest
import torch

from tests.markers import requires_module
from weight_transfer.backends.base import (
    ConfigurationError,
    RegionRole,
    TransportConfig,
    TransportError,
    TransportUnavailableError,
    WriteOp,
)
from weight_transfer.backends.nixl import (
    NixlTransport,
    _decode_payload,
    _encode_payload,
    _process_environment,
    _Target,
)


def test_payload_round_trip_and_garbage() -> None:
    target = _Target("agent-a", 4096, 100, 0, "DRAM", b"\x00md")
    assert _decode_payload(_encode_payload(target)) == target
    bad_payloads = [
        b"",
        b"\xc1",
        msgpack.packb(["agent-a", 4096, 100, 0, "HBM", b""]),
        msgpack.packb(["agent-a", -1, 100, 0, "DRAM", b""]),
        msgpack.packb(["agent-a", 4096, 100, 0, "DRAM"]),
    ]
    for bad in bad_payloads:
        with pytest.raises(ValueError):
            _decode_payload(bad)


def test_segments_split_long_writes_at_the_limit() -> None:
    pieces = [(1000, 0, 5000, 0, 25, 1), (2000, 0, 6000, 0, 3, 2)]
    segments = NixlTransport._segments(pieces, 10)
    assert [[p[4] for p in seg] for seg in segments] == [[10], [10], [5, 3]]
    assert segments[1][0][:3] == (1010, 0, 5010)
    assert segments[2][1][:3] == (2000, 0, 6000)
    assert NixlTransport._segments(pieces, 0) == [pieces]  # 0: uncut (GPU default)


@requires_module("nixl_cu13")
def test_segment_defaults_by_memory_type_and_override() -> None:
    """Host sources: 64 MiB segments; GPU sources: one transfer; the option sets both."""
    default = NixlTransport(TransportConfig(name="nixl"))
    given = NixlTransport(
        TransportConfig(name="nixl", options=(("segment_bytes", "4096"), ("window", "2")))
    )
    try:
        assert default._segment_bytes == {"DRAM": 64 << 20, "VRAM": 0}
        assert default._window == 0
        assert given._segment_bytes == {"DRAM": 4096, "VRAM": 4096}
        assert given._window == 2
    finally:
        default.close()
        given.close()


def test_missing_wheel_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)
    with pytest.raises(TransportUnavailableError, match=r"pip install nixl-cu13==1\.5\.1"):
        NixlTransport(TransportConfig(name="nixl"))


@requires_module("nixl_cu13")
@pytest.mark.parametrize(
    "options",
    [
        (("no_such_option", "1"),),
        (("segment_bytes", "0"),),
        (("window", "x"),),
        (("lanes", "0"),),
        (("lanes", "-2"),),
        (("lanes", "two"),),
    ],
)
def test_bad_options_are_refused_by_name(options: tuple[tuple[str, str], ...]) -> None:
    with pytest.raises(ConfigurationError, match=options[0][0]):
        NixlTransport(TransportConfig(name="nixl", options=options))


@requires_module("nixl_cu13")
def test_repeated_batches_reuse_prepared_lists_and_write_new_bytes() -> None:
    """Every update posts the same layout with new bytes: lists are prepared once, and the
    bytes written are the new ones (a stale cached list would show old data)."""
    opts = (("segment_bytes", "4096"),)
    rx = NixlTransport(TransportConfig(name="nixl", options=opts))
    tx = NixlTransport(TransportConfig(name="nixl", options=opts))
    try:
        gen = torch.Generator().manual_seed(11)
        target = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
        tx.connect("rx", rx.endpoint())
        # registered after the endpoint exchange: its metadata travels in the descriptor
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        assert msgpack.unpackb(desc.payload)[0] == rx._agent_name
        source = torch.empty(1 << 15, dtype=torch.uint8)
        src = tx.register(source, role=RegionRole.SOURCE)
        ops = [WriteOp(src, 0, desc, 1001, 5000), WriteOp(src, 5000, desc, 30000, 27768)]
        for step in range(3):
            source.copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8, generator=gen))
            tx.wait(tx.post_writes("rx", ops), timeout_s=10)
            assert torch.equal(target[1001:6001], source[:5000]), step
            assert torch.equal(target[30000:57768], source[5000:]), step
            if step == 0:
                num_prepared = len(tx._prepared)
                assert num_prepared == 8  # 32768 bytes in 4096-byte segments
        assert len(tx._prepared) == num_prepared
        assert all(p.busy == 0 and len(p.idle) == 1 for p in tx._prepared.values())
        tx.deregister(src)
        assert len(tx._prepared) == 0
    finally:
        tx.close()
        rx.close()


@requires_module("nixl_cu13")
def test_lanes_default_and_progress() -> None:
    """Default 1 lane: the caller copies inside `transfer()` (progress-driven); lanes 2: NIXL's
    pool threads complete transfers (not progress-driven)."""
    default = NixlTransport(TransportConfig(name="nixl"))
    two = NixlTransport(TransportConfig(name="nixl", options=(("lanes", "2"),)))
    try:
        assert default._lanes == 1 and default.progress_driven
        assert two._lanes == 2 and not two.progress_driven
        assert isinstance(two, NixlTransport) and two.name == "nixl"
    finally:
        default.close()
        two.close()


def test_lane_order_cuts_equal_runs_listed_last_first() -> None:
    mib = 1 << 20
    # one write of 3 MiB + 1 byte into 2 lanes: runs of 1.5 MiB and 1.5 MiB + 1, second first
    one = [(10 * mib, 0, 50 * mib, 0, 3 * mib + 1, 7)]
    runs = NixlTransport._lane_order(one, 2)
    assert [(p[0] - 10 * mib, p[2] - 50 * mib, p[4]) for p in runs] == [
        (3 * mib // 2, 3 * mib // 2, 3 * mib // 2 + 1),
        (0, 0, 3 * mib // 2),
    ]
    # two writes, 3 lanes: the runs cover every byte exactly once, each write's pieces in
    # place, and no two neighbours in the list are contiguous on both sides (NIXL would merge)
    two = [(0, 0, 100 * mib, 0, 2 * mib, 1), (5 * mib, 0, 90 * mib, 0, mib + 5, 2)]
    runs = NixlTransport._lane_order(two, 3)
    assert sum(p[4] for p in runs) == 3 * mib + 5
    covered = sorted((p[5], p[0], p[0] + p[4]) for p in runs)
    for (r0, _, e0), (r1, s1, _) in zip(covered, covered[1:], strict=False):
        assert r0 != r1 or e0 == s1
    for p, q in zip(runs, runs[1:], strict=False):
        assert not (p[0] + p[4] == q[0] and p[2] + p[4] == q[2])
    # segments smaller than a lane's minimum are not cut
    small = [(0, 0, 0, 0, mib + 3, 1)]
    assert NixlTransport._lane_order(small, 2) == small


@requires_module("nixl_cu13")
@pytest.mark.parametrize("lanes", [2, 3])
def test_laned_writes_are_bit_exact(lanes: int) -> None:
    """Segments cut into lanes (one of them not a multiple of the lane count, one of several
    writes) land bit-exact; repeated posts reuse the prepared lists."""
    opts = (("lanes", str(lanes)), ("segment_bytes", str(5 << 20)))
    rx = NixlTransport(TransportConfig(name="nixl", options=opts))
    tx = NixlTransport(TransportConfig(name="nixl", options=opts))
    try:
        gen = torch.Generator().manual_seed(1234 + lanes)
        target = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=gen)
        before = target.clone()
        tx.connect("rx", rx.endpoint())
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        source = torch.empty(11 << 20, dtype=torch.uint8)
        src = tx.register(source, role=RegionRole.SOURCE)
        odd = (7 << 20) + 3 * lanes + 1  # not a multiple of the lane count
        ops = [
            WriteOp(src, 0, desc, 17, odd),
            WriteOp(src, odd, desc, (12 << 20) - (3 << 20) - 5, 3 << 20),
            WriteOp(src, odd + (3 << 20), desc, odd + 40, 12345),
        ]
        for step in range(2):
            source.copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8, generator=gen))
            tx.wait(tx.post_writes("rx", ops), timeout_s=30)
            expected = before.clone()
            for op in ops:
                expected[op.target_offset : op.target_offset + op.nbytes] = source[
                    op.source_offset : op.source_offset + op.nbytes
                ]
            assert torch.equal(target, expected), step
            before = expected
            if step == 0:
                num_prepared = len(tx._prepared)
        assert len(tx._prepared) == num_prepared
    finally:
        tx.close()
        rx.close()


def _write_once(tx: NixlTransport, rx: NixlTransport) -> bool:
    """One write of seeded random bytes from `tx` into `rx`; whether they arrived exactly."""
    gen = torch.Generator().manual_seed(23)
    source = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
    target = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
    tx.connect("rx", rx.endpoint())
    desc = rx.register(target, role=RegionRole.TARGET).descriptor
    assert desc is not None
    src = tx.register(source, role=RegionRole.SOURCE)
    tx.wait(tx.post_writes("rx", [WriteOp(src, 0, desc, 0, source.numel())]), timeout_s=10)
    return torch.equal(target, source)


def test_process_environment_is_restored() -> None:
    """What the window sets is gone afterwards, also after an error: a variable that was set
    reads its old value, one that was not is absent again."""
    os.environ["UCX_WT_TEST_SET"] = "old"
    os.environ.pop("UCX_WT_TEST_UNSET", None)
    try:
        for fail in (False, True):
            with contextlib.suppress(RuntimeError):
                with _process_environment({"UCX_WT_TEST_SET": "a,b", "UCX_WT_TEST_UNSET": "c,d"}):
                    assert os.environ["UCX_WT_TEST_SET"] == "a,b"
                    assert os.environ["UCX_WT_TEST_UNSET"] == "c,d"
                    if fail:
                        raise RuntimeError("inside the window")
            assert os.environ["UCX_WT_TEST_SET"] == "old"
            assert "UCX_WT_TEST_UNSET" not in os.environ
    finally:
        os.environ.pop("UCX_WT_TEST_SET", None)


@requires_module("nixl_cu13")
def test_ucx_options_configure_this_agent_not_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `UCX_*` option reaches this agent's UCX context as NIXL's `engine_config`, not the
    environment: a transport name UCX does not know fails the start, a real one moves bytes,
    and the process environment never has the variable."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    with pytest.raises(TransportUnavailableError, match="could not start its UCX plugin"):
        NixlTransport(TransportConfig(name="nixl", options=(("UCX_TLS", "no_such_tl"),)))
    assert "UCX_TLS" not in os.environ
    opts = (("UCX_TLS", "sm"),)
    rx = NixlTransport(TransportConfig(name="nixl", options=opts))
    tx = NixlTransport(TransportConfig(name="nixl", options=opts))
    try:
        assert tx._agent.get_backend_params("UCX")["engine_config"] == "TLS=sm,NET_DEVICES=lo"
        assert "UCX_TLS" not in os.environ
        assert _write_once(tx, rx)
    finally:
        tx.close()
        rx.close()


@requires_module("nixl_cu13")
def test_ucx_list_options_are_set_only_while_the_agent_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A value with a comma (which `engine_config` would cut) is in the environment only while
    the agent and its UCX context start. With `UCX_TLS` naming a transport UCX does not know in
    the environment, the option's list still starts and moves bytes (UCX read the option), and
    the environment reads the old value afterwards. A comma-free option, by NIXL's rule, loses
    to the environment (as the module docstring says)."""
    monkeypatch.setenv("UCX_TLS", "no_such_tl")
    opts = (("UCX_TLS", "sm,self"),)
    rx = NixlTransport(TransportConfig(name="nixl", options=opts))
    tx = NixlTransport(TransportConfig(name="nixl", options=opts))
    try:
        assert os.environ["UCX_TLS"] == "no_such_tl"
        assert tx._agent.get_backend_params("UCX")["engine_config"] == "NET_DEVICES=lo"
        assert _write_once(tx, rx)
    finally:
        tx.close()
        rx.close()
    with pytest.raises(TransportUnavailableError):
        NixlTransport(TransportConfig(name="nixl", options=(("UCX_TLS", "sm"),)))


@requires_module("nixl_cu13")
def test_a_failed_batch_keeps_transfers_in_progress_until_they_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When one transfer of a batch fails, its other transfers may still be in PROC, reading
    their memory: they used to be released at once and the batch counted as finished with. Now
    the failed batch settles (`WriteHandle.settled`, the Transport contract) only once NIXL no
    longer reports any of its transfers in progress, and none is released before that."""
    from weight_transfer.backends import nixl as nixl_backend

    monkeypatch.setattr(nixl_backend, "_START_BUDGET_S", 60.0)  # start every segment at once
    opts = (("segment_bytes", "4096"),)
    rx = NixlTransport(TransportConfig(name="nixl", options=opts))
    tx = NixlTransport(TransportConfig(name="nixl", options=opts))
    released: list[object] = []
    real_abandon = tx._abandon

    def abandon(pending):
        released.extend(xfer for _, xfer in pending)
        real_abandon(pending)

    tx._abandon = abandon  # type: ignore[method-assign]
    try:
        target = torch.zeros(4 * 4096, dtype=torch.uint8)
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        tx.connect("rx", rx.endpoint())
        src = tx.register(torch.ones(4 * 4096, dtype=torch.uint8), role=RegionRole.SOURCE)
        handle = tx.post_writes("rx", [WriteOp(src, 0, desc, 0, 4 * 4096)])
        xfers = [xfer for _, xfer in handle.state.running]
        assert len(xfers) == 4
        # NIXL as it reports a transfer that failed while the others still run.
        reported = {id(xfers[0]): "ERR", **{id(x): "PROC" for x in xfers[1:]}}
        tx._agent.check_xfer_state = lambda xfer: reported[id(xfer)]
        with pytest.raises(TransportError, match="'rx'.*ERR"):
            tx.poll(handle)
        assert not handle.settled and not tx.quiesce(handle, 0.05)
        assert released == [xfers[0]]  # only the failed one: the others are in PROC
        reported.update({id(x): "DONE" for x in xfers[1:]})
        assert tx.quiesce(handle, 5) and handle.settled
        assert sorted(map(id, released)) == sorted(map(id, xfers))
        assert handle.state.running == []
    finally:
        tx.close()
        rx.close()


def _libefa_reason() -> str | None:
    import ctypes.util

    if ctypes.util.find_library("efa") is None:
        return "needs rdma-core's libefa (ibverbs-providers): without it there is no crash to keep"
    return None


@requires_module("nixl_cu13")
@pytest.mark.skipif(_libefa_reason() is not None, reason=_libefa_reason() or "")
@pytest.mark.parametrize("ucx_modules", [None, "^efa,^ib"])
def test_a_process_that_made_an_agent_exits_cleanly_beside_rdma_core(
    ucx_modules: str | None,
) -> None:
    """On a host with rdma-core installed, NIXL's bundled UCX used to load its efa module, whose
    host libefa brings the host's libnl beside the wheel's: the process died with SIGSEGV at
    exit (exit code -11). The backend keeps that module out unless UCX_MODULES is set, and a
    value the user set is kept."""
    import subprocess

    code = (
        "import os\n"
        "from weight_transfer.backends.base import TransportConfig, create_transport\n"
        "t = create_transport(TransportConfig(name='nixl'))\n"
        "t.close()\n"
        "print(os.environ['UCX_MODULES'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    if ucx_modules is not None:
        env["UCX_MODULES"] = ucx_modules
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.strip() == (ucx_modules or "^efa")


def _netifs_opened(options: str, listen_host: str = "127.0.0.1") -> set[str]:
    """The network interfaces a NIXL agent's UCX listens on (UCX's debug log), in a child."""
    import re
    import subprocess

    code = (
        "from weight_transfer.backends.base import TransportConfig, create_transport\n"
        f"t = create_transport(TransportConfig(name='nixl', listen_host={listen_host!r}, "
        f"options={options}))\n"
        "t.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["UCX_LOG_LEVEL"] = "debug"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    return set(re.findall(r"listening for connections .* netif (\S+)", run.stdout + run.stderr))


@requires_module("nixl_cu13")
def test_devices_reach_ucx_and_a_default_transport_stays_on_lo() -> None:
    """NIXL 1.5.1 ignores its UCX plugin's `ucx_devices` parameter: a default transport (which
    documents "never leaves this host") listened on every interface, and `ucx_devices` chose
    nothing (in the Soft-RoCE VM an update's bytes went over TCP beside the rxe device it
    named). The devices now reach UCX as NET_DEVICES: only `lo` is opened."""
    assert _netifs_opened("()") == {"lo"}
    # A listen host that is not loopback leaves the devices to the option alone.
    assert _netifs_opened("(('ucx_devices', 'lo'),)", listen_host="0.0.0.0") == {"lo"}
    with pytest.raises(ConfigurationError, match="ucx_devices.*UCX_NET_DEVICES"):
        NixlTransport(
            TransportConfig(name="nixl", options=(("ucx_devices", "lo"), ("UCX_NET_DEVICES", "lo")))
        )
