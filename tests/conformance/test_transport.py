"""The Transport conformance suite: every backend must pass all of it.

A new backend joins by being importable through `backends.base.BACKENDS`; the `backend`
fixture skips it, with its own reason, where it cannot run here. Data is always seeded random
bytes and comparisons are exact (`torch.equal`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import msgpack
import pytest
import torch

from tests.conformance._support import (
    Receiver,
    backend_of,
    case,
    first_difference,
    make_transport,
    run_sender_into_stopped_target,
    run_senders,
    seeded_bytes,
    split_odd,
)
from weight_transfer.backends.base import (
    MemoryKind,
    PeerLostError,
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportError,
    TransportTimeoutError,
    WriteOp,
)

Factory = Callable[[], Transport]


def _pair(transports: Factory) -> tuple[Transport, Transport]:
    """(receiver, sender) with the sender connected to the receiver as peer "rx"."""
    receiver, sender = transports(), transports()
    sender.connect("rx", receiver.endpoint())
    return receiver, sender


def _desc(region_descriptor: RegionDescriptor | None) -> RegionDescriptor:
    """The descriptor as a peer sees it: through bytes."""
    assert region_descriptor is not None
    return RegionDescriptor.from_bytes(region_descriptor.to_bytes())


# -- registration -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_capabilities_and_endpoint(transports: Factory) -> None:
    transport = transports()
    caps = transport.capabilities
    assert MemoryKind.HOST in caps.memory_kinds
    endpoint = transport.endpoint()
    assert isinstance(endpoint, bytes) and endpoint
    assert transport.endpoint() == endpoint


@pytest.mark.timeout(30)
def test_register_source_and_target(transports: Factory, backend: str) -> None:
    transport = transports()
    src_tensor = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    tgt_tensor = torch.randn(333, 3, generator=torch.Generator().manual_seed(2))
    tgt_before = tgt_tensor.clone()

    src = transport.register(src_tensor, role=RegionRole.SOURCE)
    tgt = transport.register(tgt_tensor, role=RegionRole.TARGET)

    assert src.role is RegionRole.SOURCE and src.descriptor is None
    assert src.nbytes == 4000 and src.kind is MemoryKind.HOST
    assert src.address == src_tensor.data_ptr()
    assert tgt.role is RegionRole.TARGET and tgt.descriptor is not None
    assert tgt.descriptor.backend == backend_of(backend)
    assert tgt.descriptor.kind is MemoryKind.HOST
    assert tgt.descriptor.nbytes == 333 * 3 * 4
    # Registration may move the storage (loopback), but never the values or the caller's view.
    assert tgt.address == tgt_tensor.data_ptr()
    assert torch.equal(tgt_tensor, tgt_before)
    assert [r.region_id for r in transport.regions] == [src.region_id, tgt.region_id]

    transport.deregister(src)
    assert [r.region_id for r in transport.regions] == [tgt.region_id]
    with pytest.raises(ValueError, match="not registered"):
        transport.deregister(src)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("role", [RegionRole.SOURCE, RegionRole.TARGET])
def test_register_refuses_noncontiguous_and_empty(transports: Factory, role: RegionRole) -> None:
    transport = transports()
    matrix = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="contiguous"):
        transport.register(matrix.t(), role=role)
    with pytest.raises(ValueError, match="non-empty"):
        transport.register(torch.empty(0), role=role)
    assert transport.regions == []


# -- descriptors --------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_descriptor_round_trip_and_garbage(transports: Factory) -> None:
    transport = transports()
    region = transport.register(seeded_bytes(4097, 4), role=RegionRole.TARGET)
    assert region.descriptor is not None
    data = region.descriptor.to_bytes()
    assert isinstance(data, bytes)
    assert RegionDescriptor.from_bytes(data) == region.descriptor
    garbage = [
        b"",
        b"\xc1",
        data[: len(data) // 2],
        msgpack.packb({"backend": "x"}),
        msgpack.packb(["loopback", "host", -1, b""]),
        msgpack.packb(["loopback", "tape", 1, b""]),
        msgpack.packb(["loopback", "host", 1, "not-bytes"]),
    ]
    for blob in garbage:
        with pytest.raises(ValueError):
            RegionDescriptor.from_bytes(blob)


# -- writes -------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_batches_at_odd_offsets_and_sizes(transports: Factory) -> None:
    """Several batches of odd-sized writes, from two source regions into two target regions."""
    receiver, sender = _pair(transports)
    target_a = seeded_bytes(3 << 20, 10)
    target_b = seeded_bytes(12345, 11)
    expected_a, expected_b = target_a.clone(), target_b.clone()
    desc_a = _desc(receiver.register(target_a, role=RegionRole.TARGET).descriptor)
    desc_b = _desc(receiver.register(target_b, role=RegionRole.TARGET).descriptor)
    source_a = seeded_bytes(2 << 20, 12)
    source_b = seeded_bytes(777, 13).view(-1)
    src_a = sender.register(source_a, role=RegionRole.SOURCE)
    src_b = sender.register(source_b, role=RegionRole.SOURCE)

    ops: list[WriteOp] = []
    # Into target a: odd-sized pieces of source a, at odd gaps so untouched bytes stay between.
    dst = 1
    for rel, size in split_odd(0, (2 << 20) - 5):
        ops.append(WriteOp(src_a, rel + 5, desc_a, dst, size))
        expected_a[dst : dst + size] = source_a[rel + 5 : rel + 5 + size]
        dst += size + 3
    # Into target b, including its very first and last byte.
    for src_off, dst_off, size in [(0, 0, 1), (1, 12344, 1), (100, 17, 677), (5, 9000, 3)]:
        ops.append(WriteOp(src_b, src_off, desc_b, dst_off, size))
        expected_b[dst_off : dst_off + size] = source_b[src_off : src_off + size]

    handles = [sender.post_writes("rx", ops[i : i + 3]) for i in range(0, len(ops), 3)]
    for handle in handles:
        sender.wait(handle, timeout_s=30)
    assert sum(h.nbytes for h in handles) == sum(op.nbytes for op in ops)
    assert torch.equal(target_a, expected_a), first_difference(target_a, expected_a)
    assert torch.equal(target_b, expected_b), first_difference(target_b, expected_b)


@pytest.mark.timeout(180)
def test_one_256mib_write(transports: Factory) -> None:
    """The largest single write the suite makes; memory stays at about 512 MiB plus overhead."""
    nbytes = 256 << 20
    receiver, sender = _pair(transports)
    target = seeded_bytes(nbytes, 20)
    desc = _desc(receiver.register(target, role=RegionRole.TARGET).descriptor)
    source = seeded_bytes(nbytes, 21)
    src = sender.register(source, role=RegionRole.SOURCE)
    handle = sender.post_writes("rx", [WriteOp(src, 0, desc, 0, nbytes)])
    sender.wait(handle, timeout_s=120)
    assert torch.equal(target, source), first_difference(target, source)


@pytest.mark.timeout(60)
def test_poll_reports_completion_and_stays_complete(transports: Factory) -> None:
    receiver, sender = _pair(transports)
    target = seeded_bytes(1 << 20, 30)
    desc = _desc(receiver.register(target, role=RegionRole.TARGET).descriptor)
    source = seeded_bytes(1 << 20, 31)
    src = sender.register(source, role=RegionRole.SOURCE)
    handle = sender.post_writes("rx", [WriteOp(src, 0, desc, 0, 1 << 20)])
    assert handle.peer == "rx" and handle.num_ops == 1 and handle.nbytes == 1 << 20
    deadline = time.monotonic() + 30
    while not sender.poll(handle):
        assert time.monotonic() < deadline, "poll never reported completion"
        time.sleep(1e-4)
    assert sender.poll(handle) is True
    sender.wait(handle, timeout_s=1)  # already complete: returns at once
    assert torch.equal(target, source)

    empty = sender.post_writes("rx", [])
    assert sender.poll(empty) is True


@pytest.mark.timeout(60)
def test_wait_timeout_raises(transports: Factory) -> None:
    """A 128 MiB batch cannot complete within 100 microseconds: wait must raise, naming the peer.

    128 MiB, as two 64 MiB writes: a backend that copies inline one segment per call (nixl over
    cma copies up to 64 MiB inside `post_writes`) still has the second one to do."""
    nbytes = 128 << 20
    half = nbytes // 2
    receiver, sender = _pair(transports)
    target = seeded_bytes(nbytes, 40)
    desc = _desc(receiver.register(target, role=RegionRole.TARGET).descriptor)
    source = seeded_bytes(nbytes, 41)
    src = sender.register(source, role=RegionRole.SOURCE)
    ops = [WriteOp(src, 0, desc, 0, half), WriteOp(src, half, desc, half, half)]
    handle = sender.post_writes("rx", ops)
    with pytest.raises(TransportTimeoutError, match="'rx'"):
        sender.wait(handle, timeout_s=1e-4)
    with pytest.raises(ValueError):
        sender.wait(handle, timeout_s=0)
    sender.wait(handle, timeout_s=60)  # it still completes afterwards
    assert torch.equal(target, source)


# -- many senders, reconnect ------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_three_sender_processes_into_one_receiver(backend: str) -> None:
    """Three spawned senders write disjoint odd ranges of one target in a spawned receiver."""
    chunk = (1 << 20) + 11
    receiver = Receiver(backend, 3 * chunk, init_seed=50)
    try:
        # Each sender leaves the first and last byte of its chunk untouched.
        plans = [[[i * chunk + 1, chunk - 2, 60 + i]] for i in range(3)]
        verdicts = run_senders(backend, receiver, plans)
        assert verdicts == ["ok"] * 3, verdicts
        verdict = receiver.check([p for plan in plans for p in plan])
        assert verdict == "ok", verdict
    finally:
        receiver.join()
    assert receiver.exit_code == 0


@pytest.mark.timeout(240)
def test_close_and_reconnect_to_same_receiver(backend: str) -> None:
    """A sender writes and closes; a new transport in a new process then writes to the same
    target."""
    nbytes = 2 << 20
    receiver = Receiver(backend, nbytes, init_seed=70)
    try:
        first = [[3, 500_001, 71]]
        second = [[600_000, 700_003, 72], [10, 100, 73]]  # overwrites part of the first
        assert run_senders(backend, receiver, [first]) == ["ok"]
        assert run_senders(backend, receiver, [second]) == ["ok"]
        verdict = receiver.check(first + second)
        assert verdict == "ok", verdict
    finally:
        receiver.join()
    assert receiver.exit_code == 0


@pytest.mark.timeout(60)
def test_close_and_reconnect_in_process(transports: Factory) -> None:
    receiver = transports()
    target = seeded_bytes(10_000, 80)
    expected = target.clone()
    desc = _desc(receiver.register(target, role=RegionRole.TARGET).descriptor)
    for round_, seed in enumerate((81, 82)):
        sender = transports()
        sender.connect("rx", receiver.endpoint())
        source = seeded_bytes(4001, seed)
        src = sender.register(source, role=RegionRole.SOURCE)
        offset = 17 + round_ * 3000
        sender.wait(sender.post_writes("rx", [WriteOp(src, 0, desc, offset, 4001)]), timeout_s=30)
        expected[offset : offset + 4001] = source
        sender.close()
        with pytest.raises(TransportError):
            sender.post_writes("rx", [WriteOp(src, 0, desc, 0, 1)])
    assert torch.equal(target, expected), first_difference(target, expected)


@pytest.mark.timeout(240)
def test_one_sided_writes_complete_while_target_process_is_stopped(backend: str) -> None:
    """A backend claiming one_sided must finish writes while the target cannot run at all
    (stopped after the sender connected: connecting may need the target)."""
    reason = case(backend).first_write_needs_target
    if reason is not None:
        pytest.skip(reason)
    probe = make_transport(backend)
    one_sided = probe.capabilities.one_sided
    probe.close()
    if not one_sided:
        pytest.skip(f"{backend!r} does not claim one-sided writes (its lanes emulate puts)")
    nbytes = 1 << 20
    receiver = Receiver(backend, nbytes, init_seed=90)
    plan = [[5, nbytes - 9, 91]]
    try:
        assert run_sender_into_stopped_target(backend, receiver, plan) == "ok"
        verdict = receiver.check(plan)
        assert verdict == "ok", verdict
    finally:
        receiver.join()
    assert receiver.exit_code == 0


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_unknown_peer(transports: Factory) -> None:
    receiver, sender = _pair(transports)
    target = seeded_bytes(100, 100)
    desc = _desc(receiver.register(target, role=RegionRole.TARGET).descriptor)
    src = sender.register(seeded_bytes(100, 101), role=RegionRole.SOURCE)
    with pytest.raises(PeerLostError, match="'nobody'"):
        sender.post_writes("nobody", [WriteOp(src, 0, desc, 0, 10)])
    with pytest.raises(PeerLostError, match="'nobody'"):
        sender.disconnect("nobody")
    with pytest.raises(ValueError, match="already connected"):
        sender.connect("rx", receiver.endpoint())
    sender.disconnect("rx")
    with pytest.raises(PeerLostError, match="'rx'"):
        sender.post_writes("rx", [WriteOp(src, 0, desc, 0, 10)])
    assert torch.equal(target, seeded_bytes(100, 100))


@pytest.mark.timeout(30)
def test_garbage_endpoint_refused(transports: Factory) -> None:
    sender = transports()
    for blob in (b"", b"\xc1\xc1", msgpack.packb({"v": 999})):
        with pytest.raises((ValueError, TransportError)):
            sender.connect("bad", blob)
    assert sender.peers == []


@pytest.mark.timeout(30)
def test_out_of_bounds_batch_refused_before_any_byte_moves(transports: Factory) -> None:
    receiver, sender = _pair(transports)
    target = seeded_bytes(4096, 110)
    desc = _desc(receiver.register(target, role=RegionRole.TARGET).descriptor)
    src = sender.register(seeded_bytes(8192, 111), role=RegionRole.SOURCE)
    good = WriteOp(src, 0, desc, 0, 100)
    bad_batches = [
        [good, WriteOp(src, 0, desc, 4000, 97)],  # target end past the region
        [good, WriteOp(src, 0, desc, -1, 10)],  # negative target offset
        [good, WriteOp(src, 8190, desc, 0, 3)],  # source end past its region
        [good, WriteOp(src, 0, desc, 0, 0)],  # empty write
    ]
    for ops in bad_batches:
        with pytest.raises(ValueError, match="'rx'"):
            sender.post_writes("rx", ops)
    assert torch.equal(target, seeded_bytes(4096, 110))


@pytest.mark.timeout(30)
def test_forged_descriptor_size_refused_before_any_byte_moves(transports: Factory) -> None:
    """A descriptor claiming more bytes than were registered must not reach the bytes beyond.

    The target is a slice of a larger tensor, so bytes past the region really exist: a backend
    that trusted the forged size would overwrite them. Refusal may come from `post_writes`
    (ValueError) or from the completion (TransportError); either way nothing changes.
    """
    receiver, sender = _pair(transports)
    whole = seeded_bytes(8192, 120)
    region = receiver.register(whole[1024:5120], role=RegionRole.TARGET)
    forged = dataclasses.replace(_desc(region.descriptor), nbytes=8192)
    src = sender.register(seeded_bytes(8192, 121), role=RegionRole.SOURCE)
    with pytest.raises((ValueError, TransportError)):
        handle = sender.post_writes("rx", [WriteOp(src, 0, forged, 4000, 200)])
        sender.wait(handle, timeout_s=10)
    assert torch.equal(whole, seeded_bytes(8192, 120)), "forged descriptor wrote bytes"


@pytest.mark.timeout(30)
def test_descriptor_of_another_backend_refused(transports: Factory, backend: str) -> None:
    receiver, sender = _pair(transports)
    target = seeded_bytes(1000, 130)
    desc = _desc(receiver.register(target, role=RegionRole.TARGET).descriptor)
    other = "tcp" if backend_of(backend) != "tcp" else "loopback"
    foreign = dataclasses.replace(desc, backend=other)
    src = sender.register(seeded_bytes(1000, 131), role=RegionRole.SOURCE)
    with pytest.raises(ValueError, match=other):
        sender.post_writes("rx", [WriteOp(src, 0, foreign, 0, 10)])
    assert torch.equal(target, seeded_bytes(1000, 130))


@pytest.mark.timeout(30)
def test_descriptor_of_another_receiver_refused(transports: Factory) -> None:
    """A descriptor published by receiver B, posted to peer A, must not be written anywhere."""
    receiver_a, sender = _pair(transports)
    receiver_b = transports()
    target_b = seeded_bytes(1000, 140)
    desc_b = _desc(receiver_b.register(target_b, role=RegionRole.TARGET).descriptor)
    src = sender.register(seeded_bytes(1000, 141), role=RegionRole.SOURCE)
    with pytest.raises((ValueError, TransportError)):
        handle = sender.post_writes("rx", [WriteOp(src, 0, desc_b, 0, 10)])
        sender.wait(handle, timeout_s=10)
    assert torch.equal(target_b, seeded_bytes(1000, 140))


@pytest.mark.timeout(30)
def test_close_is_idempotent_and_final(transports: Factory) -> None:
    transport = transports()
    transport.register(seeded_bytes(64, 150), role=RegionRole.SOURCE)
    transport.close()
    transport.close()
    assert transport.regions == []
    with pytest.raises(TransportError, match="closed"):
        transport.register(seeded_bytes(64, 151), role=RegionRole.SOURCE)
    with pytest.raises(TransportError, match="closed"):
        transport.endpoint()
