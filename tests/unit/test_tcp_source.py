"""tcp: a connection leaves from the transport's own `listen_host`, so that between two
addresses of one kernel (the Soft-RoCE VM's two hosts) it takes the route between them, not
`lo` from the destination address, which the kernel would pick."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch

from weight_transfer.backends import tcp
from weight_transfer.backends.base import (
    RegionRole,
    TransportConfig,
    WriteOp,
    create_transport,
)


@pytest.mark.parametrize(
    ("listen_host", "peer_host", "source"),
    [
        ("10.99.0.2", "10.99.0.1", ("10.99.0.2", 0)),
        ("127.0.0.2", "127.0.0.1", ("127.0.0.2", 0)),
        ("127.0.0.1", "10.99.0.1", None),  # a loopback source cannot reach another host
        ("10.99.0.2", "127.0.0.1", None),
        ("0.0.0.0", "10.99.0.1", None),  # a wildcard: the kernel chooses
        ("::", "10.99.0.1", None),
        ("fd00::2", "10.99.0.1", None),  # other IP version
        ("10.99.0.2", "engine-host", None),  # names: the kernel chooses
        ("trainer-host", "10.99.0.1", None),
    ],
)
def test_source_address(listen_host: str, peer_host: str, source: tuple[str, int] | None) -> None:
    assert tcp._source_address(listen_host, peer_host) == source


def _peers_of(port: int) -> set[str]:
    """Remote IPv4 addresses of the established connections to local `port` (/proc/net/tcp)."""
    peers = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == "01" and int(local.split(":")[1], 16) == port:
            raw = bytes.fromhex(remote.split(":")[0])[::-1]  # little-endian in /proc
            peers.add(".".join(str(b) for b in raw))
    return peers


def test_connection_leaves_from_the_listen_host() -> None:
    with (
        create_transport(TransportConfig(name="tcp", listen_host="127.0.0.1")) as receiver,
        create_transport(TransportConfig(name="tcp", listen_host="127.0.0.2")) as sender,
    ):
        data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        target = torch.zeros_like(data)
        region = receiver.register(target, role=RegionRole.TARGET)
        source = sender.register(data, role=RegionRole.SOURCE)
        sender.connect("receiver", receiver.endpoint())
        assert region.descriptor is not None
        handle = sender.post_writes(
            "receiver", [WriteOp(source, 0, region.descriptor, 0, data.numel())]
        )
        sender.wait(handle, 30)
        assert torch.equal(target, data)
        port = msgpack.unpackb(receiver.endpoint())["port"]
        assert _peers_of(port) == {"127.0.0.2"}
