"""The tcp data plane against strangers: forged batches, connection floods, lying lengths.

A stranger here is anyone who reaches the listener's port without the endpoint (which members
only exchange sealed on the control plane). "A member gone bad" holds the key and still cannot
make the receiver read more than the drain cap for a refused batch.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
import time

import msgpack
import pytest
import torch

from tests.conformance._support import seeded_bytes
from weight_transfer.backends import tcp
from weight_transfer.backends.base import (
    RegionRole,
    TransportConfig,
    TransportTimeoutError,
    WeightTransferError,
    WriteOp,
)
from weight_transfer.backends.tcp import TcpTransport


def _endpoint(t: TcpTransport) -> dict:
    return msgpack.unpackb(t.endpoint(), raw=False)


def _raw_connect(ep: dict, *, key: bytes | None) -> tuple[socket.socket, bytes | None]:
    """Connect and handshake; prove the key if given. Returns (socket, connection key)."""
    s = socket.create_connection((ep["host"], ep["port"]), timeout=5)
    mine = secrets.token_bytes(tcp._NONCE_BYTES)
    s.sendall(tcp._HELLO.pack(tcp._MAGIC, tcp._VERSION, 0) + mine)
    reply = tcp._recv_exact(s, tcp._HELLO.size + tcp._NONCE_BYTES + tcp._TAG_BYTES)
    assert reply is not None
    theirs = reply[tcp._HELLO.size : tcp._HELLO.size + tcp._NONCE_BYTES]
    if key is None:
        s.sendall(b"\0" * tcp._TAG_BYTES)
        return s, None
    assert reply[-tcp._TAG_BYTES :] == tcp._mac(key, b"listener", mine, theirs)
    s.sendall(tcp._mac(key, b"client", mine, theirs))
    return s, tcp._mac(key, b"conn", mine, theirs)


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


# -- issue 40, finding 13: one deadline per handshake, and the listener proves the key too ----


def _trickle(s: socket.socket, data: bytes, every_s: float, limit_s: float) -> float | None:
    """Send `data` a byte at a time; seconds until the peer closed, None if it answered."""
    t0 = time.monotonic()
    s.settimeout(every_s)
    for byte in data:
        try:
            s.sendall(bytes([byte]))
            if not s.recv(65536):
                return time.monotonic() - t0
            return None  # it answered a handshake that took longer than its deadline
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            break
    return None


@pytest.mark.timeout(60)
def test_a_trickled_handshake_is_cut_at_one_deadline() -> None:
    """Each byte of the HELLO comes within the per-read limit (1 s here), the whole takes ~8 s:
    the listener closes at its 1 s handshake deadline instead of answering."""
    rx = TcpTransport(TransportConfig(name="tcp", connect_timeout_s=1.0))
    try:
        ep = _endpoint(rx)
        hello = tcp._HELLO.pack(tcp._MAGIC, tcp._VERSION, 0) + b"\1" * tcp._NONCE_BYTES
        with socket.create_connection((ep["host"], ep["port"]), timeout=5) as s:
            closed_after = _trickle(s, hello, every_s=0.3, limit_s=9)
        assert closed_after is not None, "the listener answered a handshake trickled past 1 s"
        assert closed_after < 2.0, f"closed only after {closed_after:.1f} s"
    finally:
        rx.close()


class _FakeListener:
    """Accepts one connection on `port` (0: any) and runs `script(self, conn)` on it."""

    def __init__(self, script, port: int = 0) -> None:
        self._srv = socket.create_server(("127.0.0.1", port))
        self.port = self._srv.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.received = bytearray()
        self._script = script
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self._srv.accept()
        except OSError:
            return
        self.conns.append(conn)
        try:
            self._script(self, conn)
        except OSError:
            pass

    def endpoint(self, of: TcpTransport) -> bytes:
        """`of`'s endpoint, pointing at this listener's port."""
        ep = _endpoint(of)
        ep["port"] = self.port
        return msgpack.packb(ep, use_bin_type=True)

    def close(self) -> None:
        self._srv.close()
        for c in self.conns:
            c.close()


@pytest.mark.timeout(60)
def test_a_listener_that_trickles_its_reply_ends_the_connect_at_its_timeout() -> None:
    """The client side of the same: its connect (connecting and handshake) has one deadline."""
    rx = TcpTransport(TransportConfig(name="tcp"))

    def trickle(fake: _FakeListener, conn: socket.socket) -> None:
        conn.recv(tcp._HELLO.size + tcp._NONCE_BYTES)
        for _ in range(200):
            conn.sendall(b"\0")
            time.sleep(0.3)

    fake = _FakeListener(trickle)
    tx = TcpTransport(TransportConfig(name="tcp", connect_timeout_s=1.0))
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError, match="did not finish the handshake"):
            tx.connect("rx", fake.endpoint(rx))
        assert time.monotonic() - t0 < 2.0
    finally:
        tx.close()
        fake.close()
        rx.close()


@pytest.mark.timeout(60)
def test_a_program_on_an_exited_engines_port_gets_no_weights_and_acks_nothing() -> None:
    """An engine's transport exits; another program binds its port and answers the handshake
    with the listener id it saw in the clear (the endpoint's key it never had). Before, the
    client checked only that id: it sent its weights there and the impostor's acks completed
    the writes, so an update could commit without the engine. Now the listener must prove
    the key first, and the connect fails naming that."""
    rx = TcpTransport(TransportConfig(name="tcp"))
    target = seeded_bytes(4096, 1)
    desc = rx.register(target, role=RegionRole.TARGET).descriptor
    ep = _endpoint(rx)

    def impostor(fake: _FakeListener, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        try:
            conn.recv(4096)  # the client's HELLO (and, in this protocol, its nonce)
        except TimeoutError:
            pass
        conn.sendall(tcp._HELLO.pack(tcp._MAGIC, tcp._VERSION, ep["id"]) + b"\7" * 16)
        try:
            fake.received += conn.recv(65536)  # a client that checks nothing proves itself
        except TimeoutError:
            conn.sendall(b"\0" * tcp._TAG_BYTES)  # one that waits for a proof: a forged one
        conn.settimeout(5)
        while True:  # then take every batch and acknowledge it
            head = tcp._recv_exact(conn, tcp._FRAME.size)
            if head is None:
                return
            _, num_ops, batch_id = tcp._FRAME.unpack(head)
            table = tcp._recv_exact(conn, num_ops * tcp._OP.size + tcp._TAG_BYTES) or b""
            ops = list(tcp._OP.iter_unpack(table[: -tcp._TAG_BYTES]))
            fake.received += tcp._recv_exact(conn, sum(n for _, _, n in ops)) or b""
            conn.sendall(tcp._FRAME.pack(tcp._ACK, 0, batch_id))

    port = ep["port"]
    rx.close()  # the engine exits; the impostor takes its port
    fake = _FakeListener(impostor, port)
    tx = TcpTransport(TransportConfig(name="tcp", connect_timeout_s=5.0))
    src = seeded_bytes(4096, 9)
    sreg = tx.register(src, role=RegionRole.SOURCE)
    try:
        with pytest.raises(WeightTransferError, match="did not prove it holds the endpoint's key"):
            tx.connect("rx", msgpack.packb(ep, use_bin_type=True))
            tx.wait(tx.post_writes("rx", [WriteOp(sreg, 0, desc, 0, 4096)]), 10)
        assert src.numpy().tobytes() not in bytes(fake.received)
    finally:
        tx.close()
        fake.close()
