"""The tcp data plane against strangers: forged batches, connection floods, lying lengths.

A stranger here is anyone who reaches the listener's port without the endpoint (which members
only exchange sealed on the control plane). "A member gone bad" holds the key and still cannot
make the receiver read more than the drain cap for a refused batch.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading
import time

import msgpack
import pytest
import torch

from tests.conformance._support import seeded_bytes
from weight_transfer.backends import tcp
from weight_transfer.backends.base import RegionRole, TransportConfig, WriteOp
from weight_transfer.backends.tcp import TcpTransport


def _endpoint(t: TcpTransport) -> dict:
    return msgpack.unpackb(t.endpoint(), raw=False)


def _raw_connect(ep: dict, *, key: bytes | None) -> tuple[socket.socket, bytes | None]:
    """Connect and handshake; prove the key if given. Returns (socket, connection key)."""
    s = socket.create_connection((ep["host"], ep["port"]), timeout=5)
    s.sendall(tcp._HELLO.pack(tcp._MAGIC, tcp._VERSION, 0))
    reply = tcp._recv_exact(s, tcp._HELLO.size + tcp._NONCE_BYTES)
    assert reply is not None
    nonce = reply[tcp._HELLO.size :]
    if key is None:
        s.sendall(b"\0" * tcp._TAG_BYTES)
        return s, None
    s.sendall(tcp._mac(key, b"client", nonce))
    return s, tcp._mac(key, b"conn", nonce)


def _closed_within(s: socket.socket, timeout_s: float) -> bool:
    s.settimeout(timeout_s)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _batch(key: int, offset: int, length: int, batch_id: int = 1) -> bytes:
    return tcp._FRAME.pack(tcp._BATCH, 1, batch_id) + tcp._OP.pack(key, offset, length)


@pytest.fixture
def receiver():
    rx = TcpTransport(TransportConfig(name="tcp"))
    target = seeded_bytes(4096, 1)
    region = rx.register(target, role=RegionRole.TARGET)
    yield rx, target, msgpack.unpackb(region.descriptor.payload)["key"], region
    rx.close()


@pytest.mark.timeout(30)
def test_stranger_without_the_key_is_closed_before_any_batch(receiver) -> None:
    rx, target, key, _ = receiver
    s, _ = _raw_connect(_endpoint(rx), key=None)
    s.sendall(_batch(key, 0, 16) + b"\0" * 32 + b"\xff" * 16)
    assert _closed_within(s, 5)
    assert torch.equal(target, seeded_bytes(4096, 1))


@pytest.mark.timeout(30)
def test_forged_batch_tag_is_refused_and_nothing_written(receiver) -> None:
    """Even on a connection proven with the key, a batch whose header tag is wrong (a batch
    recorded from another connection, or altered) closes the connection unread."""
    rx, target, key, _ = receiver
    ep = _endpoint(rx)
    s, conn_key = _raw_connect(ep, key=ep["key"])
    other = hmac.new(b"another connection's key", _batch(key, 0, 16), hashlib.sha256).digest()
    s.sendall(_batch(key, 0, 16) + other + b"\xff" * 16)
    assert _closed_within(s, 5)
    assert torch.equal(target, seeded_bytes(4096, 1))
    # The genuine tag on a fresh connection is accepted (the test speaks the real protocol).
    s, conn_key = _raw_connect(ep, key=ep["key"])
    table = _batch(key, 0, 16)
    s.sendall(table + tcp._mac(conn_key, tcp._SEQ.pack(0), table) + b"\xff" * 16)
    reply = tcp._recv_exact(s, tcp._FRAME.size)
    assert reply is not None and tcp._FRAME.unpack(reply)[0] == tcp._ACK
    assert torch.equal(target[:16], torch.full((16,), 255, dtype=torch.uint8))
    # Replaying that same batch (same tag) on the connection is refused: the sequence moved.
    s.sendall(table + tcp._mac(conn_key, tcp._SEQ.pack(0), table) + b"\xee" * 16)
    assert _closed_within(s, 5)
    assert torch.equal(target[:16], torch.full((16,), 255, dtype=torch.uint8))
    s.close()


@pytest.mark.timeout(30)
def test_lying_length_of_a_refused_batch_is_not_drained(receiver) -> None:
    """A member holding the key sends a refused batch (unknown region key) that claims 1 TiB of
    payload: the receiver closes the connection instead of reading it."""
    rx, _, key, _ = receiver
    ep = _endpoint(rx)
    s, conn_key = _raw_connect(ep, key=ep["key"])
    table = _batch(key ^ 1, 0, 1 << 40)
    t0 = time.monotonic()
    s.sendall(table + tcp._mac(conn_key, tcp._SEQ.pack(0), table))
    assert _closed_within(s, 5)
    assert time.monotonic() - t0 < 5
    # A small refused batch is drained and answered, and the connection carries on.
    s, conn_key = _raw_connect(ep, key=ep["key"])
    table = _batch(key ^ 1, 0, 100)
    s.sendall(table + tcp._mac(conn_key, tcp._SEQ.pack(0), table) + b"\0" * 100)
    reply = tcp._recv_exact(s, tcp._FRAME.size)
    assert reply is not None and tcp._FRAME.unpack(reply)[0] == tcp._ERROR
    s.close()


@pytest.mark.timeout(60)
def test_connection_flood_is_bounded_and_members_still_get_through(receiver) -> None:
    rx, target, _, region = receiver
    ep = _endpoint(rx)
    base = threading.active_count()
    flood = []
    for _ in range(tcp._MAX_HANDSHAKES * 3):  # connect and never say hello
        flood.append(socket.create_connection((ep["host"], ep["port"]), timeout=5))
    time.sleep(0.5)
    grown = threading.active_count() - base
    assert grown <= tcp._MAX_HANDSHAKES, f"{grown} threads for {len(flood)} idle connections"
    closed = sum(_closed_within(s, 0.05) for s in flood)
    assert closed >= len(flood) - tcp._MAX_HANDSHAKES, closed
    # Idle handshakes expire; then a member connects and writes as usual.
    time.sleep(tcp._HANDSHAKE_TIMEOUT_S + 0.5)
    tx = TcpTransport(TransportConfig(name="tcp"))
    try:
        tx.connect("rx", rx.endpoint())
        src = seeded_bytes(4096, 9)
        sreg = tx.register(src, role=RegionRole.SOURCE)
        tx.wait(tx.post_writes("rx", [WriteOp(sreg, 0, region.descriptor, 0, 4096)]), 10)
        assert torch.equal(target, src)
    finally:
        tx.close()
        for s in flood:
            s.close()
