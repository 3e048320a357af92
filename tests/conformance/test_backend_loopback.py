"""Loopback-specific behaviour beyond the shared suite: in-place shm targets, host identity."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import msgpack
import pytest
import torch

from tests.conformance._support import Receiver, seeded_bytes
from weight_transfer.backends.base import (
    ConfigurationError,
    PeerLostError,
    RegionDescriptor,
    RegionRole,
    TransportConfig,
    WriteOp,
)
from weight_transfer.backends.loopback import LoopbackTransport


@pytest.fixture
def pair() -> Iterator[tuple[LoopbackTransport, LoopbackTransport]]:
    receiver = LoopbackTransport(TransportConfig(name="loopback"))
    sender = LoopbackTransport(TransportConfig(name="loopback"))
    sender.connect("rx", receiver.endpoint())
    yield receiver, sender
    sender.close()
    receiver.close()


def _shm_name(payload: bytes) -> str:
    name: str = msgpack.unpackb(payload)["shm"]
    return name


@pytest.mark.timeout(30)
def test_target_registration_moves_module_storage_in_place(
    pair: tuple[LoopbackTransport, LoopbackTransport],
) -> None:
    receiver, sender = pair
    torch.manual_seed(0)
    module = torch.nn.Linear(64, 32)
    row_view = module.weight.detach()[3:5]
    old_ptr = module.weight.data_ptr()
    old_view_delta = row_view.data_ptr() - old_ptr
    values = module.weight.detach().clone()
    x = torch.randn(4, 64)
    y = module(x)

    region = receiver.register(module.weight, role=RegionRole.TARGET)

    assert module.weight.data_ptr() != old_ptr, "storage was not moved into shared memory"
    assert row_view.data_ptr() - module.weight.data_ptr() == old_view_delta
    assert region.address == module.weight.data_ptr()
    assert torch.equal(module.weight.detach(), values)
    assert torch.equal(module(x), y)
    assert region.descriptor is not None
    assert os.path.exists("/dev/shm/" + _shm_name(region.descriptor.payload))

    # A write through the sender is seen by the live module parameter and the old view.
    new_values = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    src = sender.register(new_values, role=RegionRole.SOURCE)
    nbytes = new_values.numel() * 4
    sender.wait(sender.post_writes("rx", [WriteOp(src, 0, region.descriptor, 0, nbytes)]), 10)
    assert torch.equal(module.weight.detach(), new_values)
    assert torch.equal(row_view, new_values[3:5])


@pytest.mark.timeout(30)
def test_slices_of_one_storage_share_one_segment(
    pair: tuple[LoopbackTransport, LoopbackTransport],
) -> None:
    receiver, _ = pair
    whole = seeded_bytes(10_000, 2)
    first = receiver.register(whole[:4000], role=RegionRole.TARGET)
    second = receiver.register(whole[6000:], role=RegionRole.TARGET)
    assert first.descriptor is not None and second.descriptor is not None
    a = msgpack.unpackb(first.descriptor.payload)
    b = msgpack.unpackb(second.descriptor.payload)
    assert a["shm"] == b["shm"]
    assert b["off"] - a["off"] == 6000
    assert torch.equal(whole, seeded_bytes(10_000, 2))


@pytest.mark.timeout(30)
def test_peer_on_another_host_refused() -> None:
    with LoopbackTransport(TransportConfig(name="loopback")) as transport:
        endpoint = msgpack.unpackb(transport.endpoint())
        endpoint["host"] = "elsewhere/00000000-0000-0000-0000-000000000000"
        with pytest.raises(ConfigurationError, match="'far'.*elsewhere"):
            transport.connect("far", msgpack.packb(endpoint))
        assert transport.peers == []


@pytest.mark.timeout(120)
def test_segment_of_exited_receiver_reported_as_peer_lost() -> None:
    """After the receiver process exits, torch unlinks its segment: the first write says so."""
    receiver = Receiver("loopback", 4096, init_seed=3)
    try:
        assert receiver.check([]) == "ok"
    finally:
        receiver.join()
    assert receiver.exit_code == 0
    desc = RegionDescriptor.from_bytes(receiver.descriptor)
    assert not os.path.exists("/dev/shm/" + _shm_name(desc.payload))
    with LoopbackTransport(TransportConfig(name="loopback")) as sender:
        sender.connect("rx", receiver.endpoint)
        src = sender.register(seeded_bytes(4096, 4), role=RegionRole.SOURCE)
        with pytest.raises(PeerLostError, match="'rx'.*gone"):
            sender.post_writes("rx", [WriteOp(src, 0, desc, 0, 10)])


@pytest.mark.timeout(120)
def test_killed_receiver_reported_as_peer_lost_on_poll_and_post() -> None:
    """A one-sided write into a killed engine's mapping would "succeed": the peer's process is
    checked instead, so the pending batch's poll and the next post raise, naming the peer."""
    nbytes = 1 << 20
    receiver = Receiver("loopback", nbytes, init_seed=5)
    try:
        desc = RegionDescriptor.from_bytes(receiver.descriptor)
        with LoopbackTransport(TransportConfig(name="loopback")) as sender:
            sender.connect("engine-0", receiver.endpoint)
            src = sender.register(seeded_bytes(nbytes, 6), role=RegionRole.SOURCE)
            ops = [WriteOp(src, 0, desc, 0, nbytes)]
            sender.wait(sender.post_writes("engine-0", ops), timeout_s=30)  # alive: completes
            pending = sender.post_writes("engine-0", ops)
            receiver.kill()
            assert receiver.exit_code == -signal.SIGKILL
            with pytest.raises(PeerLostError, match=r"'engine-0'.*process \d+ has exited"):
                sender.wait(pending, timeout_s=30)
            with pytest.raises(PeerLostError, match="'engine-0'"):
                sender.poll(pending)  # the failure sticks
            with pytest.raises(PeerLostError, match=r"'engine-0'.*process \d+ has exited"):
                sender.post_writes("engine-0", ops)
    finally:
        receiver.join()


@pytest.mark.timeout(30)
def test_capabilities() -> None:
    with LoopbackTransport(TransportConfig(name="loopback")) as transport:
        caps = transport.capabilities
        assert caps.one_sided is True and caps.cross_host is False
        assert ("cuda" in {k.value for k in caps.memory_kinds}) == torch.cuda.is_available()
