"""TCP transport: a simulator of an RDMA NIC across hosts, for CI, laptops and clusters without
RDMA.

Every transport listens from construction, on `TransportConfig.listen_host` at a port the kernel
picks, or at the first free one of option ``port_range`` ("30000-30099": one port per member on
a host, so a firewall between hosts can open exactly that range); its endpoint advertises
`TransportConfig.advertise_host` (else the bound address). A passive receive thread per
incoming connection plays the NIC: for each batch it reads the table of (region key, offset,
length) first, checks every entry against the registered TARGET regions, and only then
receives the payload straight
into the registered memory (`recv_into`, or `recvmsg_into` over up to 512 host ranges at once,
memoryviews over the addresses; ranges that continue one another are merged first; CUDA targets
go through a host bounce buffer). The sender gathers host sources the same way (`sendmsg`). A
refused batch writes nothing: its payload is drained and an error frame
names the reason. Each batch is acknowledged; the sender completes its handle on the ack. A
posted batch of more than `_MAX_OPS_PER_BATCH` writes (what a receiver takes in one frame) goes
out as several wire batches under one handle, complete when all are acknowledged; if one is
refused the handle fails naming why (the parts before it may have landed, as after any failed
batch).

Outgoing connections start from `listen_host` where that is a specific address of the same
kind as the peer's (both loopback or both not, same IP version; see `_source_address`), so a
member with several addresses sends from the one it was given, as it listens on it. Left to the
kernel, a connection between two addresses of one host leaves from the destination address over
`lo`: with two "hosts" wired inside one kernel (the Soft-RoCE VM's two ends of a veth pair), the
bytes would never cross the wire between them.

Authentication: every transport draws a random 256-bit key when it starts; it travels only
inside its endpoint, which members exchange sealed on the control plane. The handshake is a
mutual proof of that key over both sides' fresh nonces: the listener proves it first, so a
program that binds an exited engine's port (and echoes its listener id, which anyone who
connected to it saw) receives no weights and cannot acknowledge any; then the client proves
it, before anything else is read. Every batch's header (frame and op table) carries an
HMAC-SHA256 under a per-connection key and the batch's sequence number, so a stranger who
reaches the port can neither write nor replay a recorded batch; the header is checked before a
single payload byte is read. (The payload itself rides the authenticated TCP stream; an
attacker able to inject into an established stream is out of scope: use a private network.)
Each side's handshake has one deadline for the whole exchange, however the bytes trickle in
(the listener's: `min(connect_timeout_s, _HANDSHAKE_TIMEOUT_S)`; the client's:
`connect_timeout_s`, connecting included). Connections are bounded (`_MAX_CONNECTIONS` served,
`_MAX_HANDSHAKES` unproven), and a refused batch makes the receiver read at most
`_MAX_DRAIN_BYTES` more; a claim of more closes the connection.

Wire format (network byte order, no pickle anywhere):
- handshake: client sends `HELLO` (magic, version, 0) and a 16-byte nonce c; the listener
  answers with `HELLO` carrying its 64-bit listener id (the client checks it against the
  endpoint it was given), a 16-byte nonce l and HMAC(key, "listener" || c || l), which the
  client checks before it sends anything more; the client answers HMAC(key, "client" || c ||
  l). The connection key is HMAC(key, "conn" || c || l).
- client -> listener: `FRAME` (type BATCH, number of ops, batch id), then number-of-ops `OP`
  entries (region key, offset, length), then the 32-byte tag HMAC(connection key, sequence ||
  frame || table), then the payload of every op in table order.
- listener -> client: `FRAME` (type ACK, 0, batch id) or (type ERROR, message length,
  batch id) followed by a UTF-8 message.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Any

import msgpack
import torch

from weight_transfer.backends._memory import host_view
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
    TransportTimeoutError,
    WriteHandle,
    WriteOp,
)

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)

_VERSION = 3
_MAGIC = b"WTT3"
_HELLO = struct.Struct("!4sHxxQ")  # magic, version, listener id (0 from the client)
_FRAME = struct.Struct("!BxxxIQ")  # type, count (ops or message bytes), batch id
_OP = struct.Struct("!QQQ")  # region key, offset, length
_BATCH, _ACK, _ERROR = 1, 2, 3
_MAX_OPS_PER_BATCH = 1 << 20
_MAX_ERROR_BYTES = 1 << 16
_IOV_MAX = 512  # buffers per sendmsg/recvmsg_into call (Linux allows 1024)
_SEND_BYTES = 1 << 20  # bytes per send call
_CHUNK_BYTES = 64 << 20  # bounce-buffer and drain chunk
_JOIN_TIMEOUT_S = 10.0
_ACCEPT_POLL_S = 0.2
_NONCE_BYTES = 16
_TAG_BYTES = 32
_SEQ = struct.Struct("!Q")
_MAX_CONNECTIONS = 256
"""Connections served at once (every trainer rank opens one per engine it writes to)."""
_MAX_HANDSHAKES = 32
"""Connections accepted but not yet proven to hold the key; more are closed at once."""
_HANDSHAKE_TIMEOUT_S = 5.0
_MAX_DRAIN_BYTES = 64 << 20
"""Most payload bytes a refused (authenticated) batch may make the receiver read and discard."""


def _port_range(value: str | None) -> range:
    """Ports option ``port_range`` ("first-last", inclusive) allows; default: one the kernel
    picks (its ephemeral range).

    Raises:
        ConfigurationError: not "first-last" with 1 <= first <= last <= 65535.
    """
    if value is None or value.strip() == "0":
        return range(0, 1)
    first, sep, last = value.partition("-")
    try:
        lo, hi = int(first), int(last if sep else first)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi <= 65535:
        raise ConfigurationError(
            f"tcp option port_range={value!r}: expected 'first-last' with 1 <= first <= last "
            "<= 65535 (or '0': a port the kernel picks)"
        )
    return range(lo, hi + 1)


def _listen(host: str, ports: range) -> socket.socket:
    """A listening socket on `host` at the first free port of `ports`."""
    last: OSError | None = None
    for port in ports:
        try:
            return socket.create_server((host, port), backlog=64)
        except OSError as exc:
            last = exc
    what = "a port the kernel picks" if ports == range(0, 1) else f"ports {ports[0]}-{ports[-1]}"
    raise TransportError(f"tcp: cannot listen on {host!r} ({what}): {last}") from last


def _source_address(listen_host: str, peer_host: str) -> tuple[str, int] | None:
    """Where a connection to `peer_host` starts: `(listen_host, any port)` when both are IP
    addresses of one version, `listen_host` is not a wildcard, and either both or neither are
    loopback (a loopback source cannot reach another host); else None, the kernel's choice."""
    try:
        own = ipaddress.ip_address(listen_host)
        peer = ipaddress.ip_address(peer_host)
    except ValueError:  # host names: the kernel chooses
        return None
    if own.is_unspecified or own.version != peer.version or own.is_loopback != peer.is_loopback:
        return None
    return listen_host, 0


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float | None = None) -> bytes | None:
    """Read exactly `nbytes`; None on EOF before the first byte; ConnectionError on EOF inside.

    With a `deadline` (`time.monotonic()`), the whole read ends there (TimeoutError), however
    the bytes trickle in: each `recv` waits only for the time left.
    """
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {got} of {nbytes} bytes")
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return bytes(buf)


def _recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view`. `MSG_WAITALL` lets the kernel copy the whole payload in one call, as it
    arrives, instead of returning to Python (and the GIL) for every chunk it has queued."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {total} payload bytes")
        got += n


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every view in order: up to `_IOV_MAX` views and `_SEND_BYTES` per `sendmsg` call.

    Gathering many small writes into one syscall is what a NIC's gather list does. Capping a
    call's bytes matters on loopback: one blocking 64 MiB send holds the socket for the whole
    copy, while the receiver's acknowledgements wait in the backlog.
    """
    pending = collections.deque(views)
    while pending:
        batch: list[memoryview] = []
        size = 0
        while pending and len(batch) < _IOV_MAX and size < _SEND_BYTES:
            view = pending.popleft()
            room = _SEND_BYTES - size
            if len(view) > room:
                pending.appendleft(view[room:])
                view = view[:room]
            batch.append(view)
            size += len(view)
        sent = sock.sendmsg(batch) if len(batch) > 1 else sock.send(batch[0])
        if sent < size:  # put the unsent rest back, in order
            rest: list[memoryview] = []
            for view in batch:
                if sent >= len(view):
                    sent -= len(view)
                    continue
                rest.append(view[sent:])
                sent = 0
            pending.extendleft(reversed(rest))


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order, up to `_IOV_MAX` per `recvmsg_into` call."""
    if len(views) == 1:
        _recv_into_exact(sock, views[0])
        return
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("connection closed inside a batch's payload")
        for view in batch:
            if got >= len(view):
                got -= len(view)
                i += 1
                continue
            views[i] = view[got:]
            break


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge (address, length) ranges that continue one another into single ranges."""
    out: list[tuple[int, int]] = []
    for address, length in ranges:
        if out and out[-1][0] + out[-1][1] == address:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((address, length))
    return out


def _tune(sock: socket.socket) -> None:
    # Only TCP_NODELAY: setting SO_SNDBUF/SO_RCVBUF turns off the kernel's buffer autotuning,
    # which on Linux grows a loopback stream's buffers past what a fixed size may ask for
    # (net.core.rmem_max caps SO_RCVBUF; tcp_rmem's autotuning limit is usually larger).
    # Measured: fixed 8 MiB buffers made 64 MiB writes 20-40 % slower than a plain socket.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Refused(Exception):
    """A connection the listener closes: not proven, forged, or asking too much (internal)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """A registered TARGET region, as the receive threads see it."""

    tensor: torch.Tensor
    address: int
    nbytes: int
    kind: MemoryKind


class _BatchState:
    """Completion state of one posted batch (handle.state); set by the link's threads.

    A batch of more writes than a receiver takes in one frame (`_MAX_OPS_PER_BATCH`) goes out
    as several wire batches (parts) that share this state: done once every part was
    acknowledged, or at the first part that failed.
    """

    __slots__ = ("_lock", "_unacked", "_unsent", "done", "error", "sent")

    def __init__(self, parts: int = 1) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.sent = threading.Event()
        """Set once the send thread no longer reads the batch's sources: sent, or skipped
        because the link had failed, or abandoned when sending failed (every part)."""
        self._lock = threading.Lock()
        self._unacked = parts
        self._unsent = parts

    def part_done(self, error: BaseException | None) -> None:
        """A part was acknowledged, refused (`error`), or failed with the link."""
        with self._lock:
            self._unacked -= 1
            if error is not None and self.error is None:
                self.error = error
            finished = self._unacked <= 0 or self.error is not None
        if finished:
            self.done.set()

    def part_sent(self) -> None:
        """The send thread is done with a part's sources."""
        with self._lock:
            self._unsent -= 1
            finished = self._unsent <= 0
        if finished:
            self.sent.set()


class _Link:
    """The sending side of one connection to a peer: a send thread and an ack-reader thread."""

    def __init__(self, peer: str, sock: socket.socket, listener_id: int, conn_key: bytes) -> None:
        self.peer = peer
        self.sock = sock
        self.listener_id = listener_id
        self._conn_key = conn_key
        self._seq = 0
        self.failure: BaseException | None = None
        self._pending: dict[int, _BatchState] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=self._send_loop, name=f"tcp-send-{peer}", daemon=True
        )
        self._reader = threading.Thread(target=self._read_loop, name=f"tcp-ack-{peer}", daemon=True)
        self._sender.start()
        self._reader.start()

    def post(
        self, parts: list[tuple[int, bytes, list[tuple[Region, int, int]]]], state: _BatchState
    ) -> None:
        """Queue the wire batches (batch id, frame and op table, sources) of one posted batch,
        all or none."""
        with self._lock:
            if self.failure is not None:
                raise PeerLostError(f"tcp: peer {self.peer!r} is lost: {self.failure}")
            for batch_id, table, sources in parts:
                self._pending[batch_id] = state
                # Queued under the lock: a failure of the send thread (`_abandon_queued`, after
                # `failure` is set under it) then sees every batch queued before it.
                self._queue.put((batch_id, table, sources, state))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = error
            pending, self._pending = self._pending, {}
        for state in pending.values():
            state.part_done(error)

    def _send_loop(self) -> None:
        state: _BatchState | None = None
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    # Graceful end: the listener answers everything sent so far, then EOF.
                    self.sock.shutdown(socket.SHUT_WR)
                    return
                _, table, sources, state = item
                if self.failure is None:
                    self._send_batch(table, sources)
                # Else the link failed (the ack reader saw the peer go) and this batch was
                # already failed with it: its sources are never read.
                state.part_sent()
                state = None
        except OSError as exc:
            self._fail_all(PeerLostError(f"tcp: lost peer {self.peer!r} while sending: {exc}"))
            self._abandon_queued(state)
        except Exception as exc:  # never let the send thread die silently
            log.exception("tcp: send thread for peer %r failed", self.peer)
            self._fail_all(TransportError(f"tcp: sending to peer {self.peer!r} failed: {exc}"))
            self._abandon_queued(state)

    def _abandon_queued(self, current: _BatchState | None) -> None:
        """The send thread ends on an error: the batch it was sending and every queued one
        will not be read again (`failure` is set, so nothing more is queued)."""
        if current is not None:
            current.part_sent()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[3].part_sent()

    def _send_batch(self, table: bytes, sources: list[tuple[Region, int, int]]) -> None:
        """Frame, tag and payload of one batch (the payload straight from the sources)."""
        tag = _mac(self._conn_key, _SEQ.pack(self._seq), table)
        self._seq += 1
        views = [memoryview(table), memoryview(tag)]
        host: list[tuple[int, int]] = []
        for region, offset, nbytes in sources:
            if region.kind is MemoryKind.HOST:
                host.append((region.address + offset, nbytes))
                continue
            views += [host_view(a, n) for a, n in _coalesce(host)]
            host = []
            _send_views(self.sock, views)
            views = []
            for begin in range(offset, offset + nbytes, _CHUNK_BYTES):
                end = min(begin + _CHUNK_BYTES, offset + nbytes)
                self.sock.sendall(region.tensor[begin:end].cpu().numpy().data)
        views += [host_view(a, n) for a, n in _coalesce(host)]
        if views:
            _send_views(self.sock, views)

    def _read_loop(self) -> None:
        try:
            while True:
                raw = _recv_exact(self.sock, _FRAME.size)
                if raw is None:
                    self._fail_all(PeerLostError(f"tcp: peer {self.peer!r} closed the connection"))
                    return
                kind, count, batch_id = _FRAME.unpack(raw)
                if kind == _ACK:
                    error = None
                elif kind == _ERROR and count <= _MAX_ERROR_BYTES:
                    message = (_recv_exact(self.sock, count) or b"").decode("utf-8", "replace")
                    error = TransportError(f"tcp: peer {self.peer!r} refused a write: {message}")
                else:
                    raise ConnectionError(f"unexpected frame type {kind} from the listener")
                with self._lock:
                    state = self._pending.pop(batch_id, None)
                if state is None:
                    raise ConnectionError(f"reply for unknown batch {batch_id}")
                state.part_done(error)
        except OSError as exc:
            self._fail_all(PeerLostError(f"tcp: lost peer {self.peer!r}: {exc}"))
        except Exception as exc:  # never let the reader die silently
            log.exception("tcp: ack reader for peer %r failed", self.peer)
            self._fail_all(TransportError(f"tcp: reading from peer {self.peer!r} failed: {exc}"))
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already disconnected

    def close(self, timeout_s: float) -> None:
        """Send what is queued, wait up to `timeout_s` for its acks, then close the socket."""
        self._queue.put(None)
        self._sender.join(timeout=timeout_s)
        self._reader.join(timeout=timeout_s)
        if self._sender.is_alive() or self._reader.is_alive():
            log.warning(
                "tcp: link to peer %r did not drain in %.0f s; cutting it", self.peer, timeout_s
            )
        self._shutdown()
        self._sender.join(timeout=timeout_s)
        self._reader.join(timeout=timeout_s)
        self.sock.close()
        self._fail_all(TransportError(f"tcp: disconnected from peer {self.peer!r}"))


class TcpTransport(Transport):
    """Writes over TCP into memory registered by a peer's receive thread.

    `capabilities.one_sided` is False, honestly: the target process runs a receive thread that
    copies each write into place (the simulated NIC). The target's own code still runs nothing
    per write, which is all the engine-side design needs. `post_writes` never blocks: a send
    thread per peer drains a queue of batches. Batches to one peer are sent and acknowledged in
    posting order, but the contract promises no ordering.
    """

    name = "tcp"
    option_names = frozenset({"port_range"})

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        kinds = {MemoryKind.HOST}
        if torch.cuda.is_available():
            kinds.add(MemoryKind.CUDA)
        self._caps = TransportCapabilities(
            memory_kinds=frozenset(kinds), one_sided=False, cross_host=True
        )
        self._listener_id = secrets.randbits(64)
        self._key = secrets.token_bytes(32)  # who holds the endpoint may write; nobody else
        self._handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        self._targets: dict[int, _Target] = {}
        self._targets_lock = threading.Lock()
        self._region_keys: dict[int, int] = {}  # region id -> key
        self._links: dict[str, _Link] = {}
        self._batch_ids = 0
        self._stopping = threading.Event()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self._listener = _listen(config.listen_host, _port_range(config.option("port_range")))
        self._listener.settimeout(_ACCEPT_POLL_S)
        host, port = self._listener.getsockname()[:2]
        if config.advertise_host is not None:
            host = config.advertise_host
        elif host in ("0.0.0.0", "::"):
            host = socket.getfqdn()
        self._endpoint_bytes = msgpack.packb(
            {"v": _VERSION, "host": host, "port": port, "id": self._listener_id, "key": self._key},
            use_bin_type=True,
        )
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"tcp-accept-{port}", daemon=True
        )
        self._acceptor.start()

    # -- capabilities / endpoint ----------------------------------------------------------

    def _capabilities(self) -> TransportCapabilities:
        return self._caps

    def _endpoint(self) -> bytes:
        return self._endpoint_bytes

    # -- registration ---------------------------------------------------------------------

    def _register(self, region_id: int, flat: torch.Tensor, role: RegionRole) -> Region:
        kind = MemoryKind.of(flat)
        descriptor = None
        if role is RegionRole.TARGET:
            key = secrets.randbits(64)
            with self._targets_lock:
                while key == 0 or key in self._targets:
                    key = secrets.randbits(64)
                self._targets[key] = _Target(flat, flat.data_ptr(), flat.numel(), kind)
            self._region_keys[region_id] = key
            payload = msgpack.packb(
                {"v": _VERSION, "id": self._listener_id, "key": key}, use_bin_type=True
            )
            descriptor = RegionDescriptor(
                backend=self.name, kind=kind, nbytes=flat.numel(), payload=payload
            )
        return Region.of(region_id, flat, role, descriptor)

    def _deregister(self, region: Region) -> None:
        key = self._region_keys.pop(region.region_id, None)
        if key is not None:
            with self._targets_lock:
                self._targets.pop(key, None)

    # -- the simulated NIC: accept and receive --------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stopping.is_set():
                    log.error("tcp: accept failed, listener stops: %s", exc)
                return
            if not self._handshakes.acquire(blocking=False):
                log.warning(
                    "tcp: %d handshakes already pending; closing a connection from %s",
                    _MAX_HANDSHAKES,
                    addr,
                )
                conn.close()
                continue
            thread = threading.Thread(
                target=self._serve, args=(conn, addr), name=f"tcp-recv-{addr}", daemon=True
            )
            with self._conns_lock:
                if self._stopping.is_set():
                    self._handshakes.release()
                    conn.close()
                    return
                if len(self._conns) >= _MAX_CONNECTIONS:
                    self._handshakes.release()
                    log.warning(
                        "tcp: %d connections already served; closing one from %s",
                        _MAX_CONNECTIONS,
                        addr,
                    )
                    conn.close()
                    continue
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        """Receive batches from one sender until EOF. Never lets an exception escape silently."""
        proven = False
        try:
            # One deadline for the whole handshake: a client that trickles its bytes in
            # cannot hold a handshake slot longer than that.
            deadline = time.monotonic() + min(self.config.connect_timeout_s, _HANDSHAKE_TIMEOUT_S)
            hello = _recv_exact(conn, _HELLO.size + _NONCE_BYTES, deadline)
            if hello is None:
                return
            magic, version, _ = _HELLO.unpack(hello[: _HELLO.size])
            if magic != _MAGIC or version != _VERSION:
                raise ConnectionError(f"bad handshake (magic {magic!r}, version {version})")
            theirs, mine = hello[_HELLO.size :], secrets.token_bytes(_NONCE_BYTES)
            conn.sendall(
                _HELLO.pack(_MAGIC, _VERSION, self._listener_id)
                + mine
                + _mac(self._key, b"listener", theirs, mine)
            )
            proof = _recv_exact(conn, _TAG_BYTES, deadline)
            if proof is None or not hmac.compare_digest(
                proof, _mac(self._key, b"client", theirs, mine)
            ):
                raise _Refused("the client does not hold this transport's key")
            proven = True
            self._handshakes.release()
            conn_key = _mac(self._key, b"conn", theirs, mine)
            seq = 0
            conn.settimeout(None)
            _tune(conn)
            while True:
                raw = _recv_exact(conn, _FRAME.size)
                if raw is None:
                    return  # the sender finished cleanly
                kind, num_ops, batch_id = _FRAME.unpack(raw)
                if kind != _BATCH or not 0 < num_ops <= _MAX_OPS_PER_BATCH:
                    raise ConnectionError(f"bad frame (type {kind}, {num_ops} ops)")
                table = _recv_exact(conn, num_ops * _OP.size + _TAG_BYTES)
                if table is None:
                    raise ConnectionError("connection closed inside a batch")
                table, tag = table[:-_TAG_BYTES], table[-_TAG_BYTES:]
                if not hmac.compare_digest(tag, _mac(conn_key, _SEQ.pack(seq), raw, table)):
                    raise _Refused(f"batch {batch_id} failed authentication")
                seq += 1
                ops = list(_OP.iter_unpack(table))
                error, targets = self._check_batch(ops)
                if error is not None:
                    claimed = sum(length for _, _, length in ops)
                    if claimed > _MAX_DRAIN_BYTES:
                        raise _Refused(
                            f"refused batch {batch_id} ({error}) claims {claimed} payload "
                            f"bytes, more than the {_MAX_DRAIN_BYTES} a refusal may drain"
                        )
                    self._drain(conn, claimed)
                    message = error.encode()[:_MAX_ERROR_BYTES]
                    conn.sendall(_FRAME.pack(_ERROR, len(message), batch_id) + message)
                    log.warning("tcp: refused batch %d from %s: %s", batch_id, addr, error)
                    continue
                host: list[tuple[int, int]] = []
                for target, (_, offset, length) in zip(targets, ops, strict=True):
                    if target.kind is MemoryKind.HOST:
                        host.append((target.address + offset, length))
                        continue
                    if host:
                        _recv_views(conn, [host_view(a, n) for a, n in _coalesce(host)])
                        host = []
                    self._receive_cuda(conn, target, offset, length)
                if host:
                    _recv_views(conn, [host_view(a, n) for a, n in _coalesce(host)])
                conn.sendall(_FRAME.pack(_ACK, 0, batch_id))
        except _Refused as exc:
            log.warning("tcp: closing the connection from %s: %s", addr, exc)
        except TimeoutError:
            log.warning("tcp: closing the connection from %s: handshake not finished in time", addr)
        except OSError as exc:
            if not self._stopping.is_set():
                log.warning("tcp: connection from %s lost: %s", addr, exc)
        except Exception:  # the receive thread must never die silently
            log.exception("tcp: receive thread for %s failed; closing that connection", addr)
        finally:
            if not proven:
                self._handshakes.release()
            with self._conns_lock:
                self._conns.pop(conn, None)
            conn.close()

    def _check_batch(self, ops: list[tuple[int, int, int]]) -> tuple[str | None, list[_Target]]:
        """Check every op against the registered targets before a single byte is received."""
        targets: list[_Target] = []
        with self._targets_lock:
            for i, (key, offset, length) in enumerate(ops):
                target = self._targets.get(key)
                if target is None:
                    return f"write {i}: unknown region key {key:#x} (not registered here)", []
                if length == 0 or offset + length > target.nbytes:
                    return (
                        f"write {i}: range [{offset}, {offset + length}) is outside the "
                        f"registered region of {target.nbytes} bytes"
                    ), []
                targets.append(target)
        return None, targets

    @staticmethod
    def _drain(conn: socket.socket, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
        while nbytes > 0:
            n = conn.recv_into(scratch[: min(nbytes, len(scratch))])
            if n == 0:
                raise ConnectionError("connection closed while draining a refused batch")
            nbytes -= n

    @staticmethod
    def _receive_cuda(conn: socket.socket, target: _Target, offset: int, length: int) -> None:
        bounce = torch.empty(min(length, _CHUNK_BYTES), dtype=torch.uint8)
        view = host_view(bounce.data_ptr(), bounce.numel())
        for begin in range(offset, offset + length, _CHUNK_BYTES):
            end = min(begin + _CHUNK_BYTES, offset + length)
            _recv_into_exact(conn, view[: end - begin])
            target.tensor[begin:end].copy_(bounce[: end - begin])

    # -- peers ----------------------------------------------------------------------------

    def _connect(self, peer: str, endpoint: bytes) -> None:
        try:
            obj = msgpack.unpackb(endpoint, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"tcp: endpoint of peer {peer!r} is not valid msgpack") from exc
        if not (
            isinstance(obj, dict)
            and obj.get("v") == _VERSION
            and isinstance(obj.get("host"), str)
            and isinstance(obj.get("port"), int)
            and isinstance(obj.get("id"), int)
            and isinstance(obj.get("key"), bytes)
        ):
            raise ValueError(f"tcp: endpoint of peer {peer!r} is not a tcp endpoint")
        address = (obj["host"], obj["port"])
        timeout_s = self.config.connect_timeout_s
        deadline = time.monotonic() + timeout_s  # connecting and the whole handshake
        try:
            sock = socket.create_connection(
                address,
                timeout=timeout_s,
                source_address=_source_address(self.config.listen_host, obj["host"]),
            )
        except TimeoutError as exc:
            raise TransportTimeoutError(
                f"tcp: peer {peer!r} at {address} did not answer within {timeout_s:.1f} s"
            ) from exc
        except OSError as exc:
            raise PeerLostError(
                f"tcp: cannot connect to peer {peer!r} at {address}: {exc}"
            ) from exc
        key: bytes = obj["key"]
        try:
            mine = secrets.token_bytes(_NONCE_BYTES)
            sock.sendall(_HELLO.pack(_MAGIC, _VERSION, 0) + mine)
            reply = _recv_exact(sock, _HELLO.size + _NONCE_BYTES + _TAG_BYTES, deadline)
            if reply is None:
                raise ConnectionError("closed during the handshake")
            magic, version, listener_id = _HELLO.unpack(reply[: _HELLO.size])
            theirs = reply[_HELLO.size : _HELLO.size + _NONCE_BYTES]
            if magic != _MAGIC or version != _VERSION:
                raise ConnectionError(f"bad handshake reply (magic {magic!r}, version {version})")
            if listener_id != obj["id"]:
                raise ConnectionError(
                    f"listener id {listener_id:#x} differs from the endpoint's {obj['id']:#x} "
                    "(a different transport now listens on that port)"
                )
            if not hmac.compare_digest(
                reply[_HELLO.size + _NONCE_BYTES :], _mac(key, b"listener", mine, theirs)
            ):
                raise ConnectionError(
                    "the listener did not prove it holds the endpoint's key (the transport that "
                    "published it is gone, and another program now listens on its port)"
                )
            sock.sendall(_mac(key, b"client", mine, theirs))
            sock.settimeout(None)
            _tune(sock)
        except TimeoutError as exc:
            sock.close()
            raise TransportTimeoutError(
                f"tcp: peer {peer!r} at {address} did not finish the handshake in {timeout_s:.1f} s"
            ) from exc
        except OSError as exc:
            sock.close()
            raise PeerLostError(
                f"tcp: handshake with peer {peer!r} at {address} failed: {exc}"
            ) from exc
        self._links[peer] = _Link(peer, sock, listener_id, _mac(key, b"conn", mine, theirs))

    def _disconnect(self, peer: str) -> None:
        link = self._links.pop(peer, None)
        if link is not None:
            link.close(_JOIN_TIMEOUT_S)

    # -- writes ---------------------------------------------------------------------------

    def _post_writes(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        link = self._links[peer]
        entries: list[bytes] = []
        keys: dict[bytes, int] = {}
        for i, op in enumerate(ops):
            key = keys.get(op.target.payload)
            if key is None:
                key = keys[op.target.payload] = self._target_key(peer, link, i, op.target)
            entries.append(_OP.pack(key, op.target_offset, op.nbytes))
        # A receiver takes at most `_MAX_OPS_PER_BATCH` writes per frame (it closes the
        # connection on more): a larger batch goes out as several, completed together.
        step = _MAX_OPS_PER_BATCH
        parts = []
        for begin in range(0, len(ops), step):
            self._batch_ids += 1
            chunk = ops[begin : begin + step]
            table = _FRAME.pack(_BATCH, len(chunk), self._batch_ids) + b"".join(
                entries[begin : begin + step]
            )
            parts.append(
                (self._batch_ids, table, [(o.source, o.source_offset, o.nbytes) for o in chunk])
            )
        state = _BatchState(len(parts))
        link.post(parts, state)
        handle.state = state

    @staticmethod
    def _target_key(peer: str, link: _Link, index: int, desc: RegionDescriptor) -> int:
        try:
            obj = msgpack.unpackb(desc.payload, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(
                f"write {index} to {peer!r}: tcp descriptor payload is garbage"
            ) from exc
        if not (
            isinstance(obj, dict)
            and obj.get("v") == _VERSION
            and isinstance(obj.get("id"), int)
            and isinstance(obj.get("key"), int)
        ):
            raise ValueError(f"write {index} to {peer!r}: tcp descriptor payload has a bad format")
        if obj["id"] != link.listener_id:
            raise ValueError(
                f"write {index} to {peer!r}: the target descriptor belongs to another transport "
                f"(listener {obj['id']:#x}, peer {peer!r} is {link.listener_id:#x})"
            )
        key: int = obj["key"]
        return key

    def _completion_event(self, handle: WriteHandle) -> threading.Event:
        state: _BatchState = handle.state
        return state.done

    def _quiesce(self, handle: WriteHandle) -> bool:
        # A batch fails as soon as the link does (the ack reader saw the peer go), while the
        # send thread may still be sending it or have it queued: quiet once that thread is
        # done with it (it skips the queued ones of a failed link).
        state: _BatchState = handle.state
        return state.sent.is_set()

    def _poll(self, handle: WriteHandle) -> bool:
        state: _BatchState = handle.state
        if not state.done.is_set():
            return False
        if state.error is not None:
            raise state.error
        return True

    # -- close ----------------------------------------------------------------------------

    def _close(self) -> None:
        for peer in list(self._links):
            self._disconnect(peer)
        self._stopping.set()
        self._acceptor.join(timeout=_JOIN_TIMEOUT_S)
        self._listener.close()
        with self._conns_lock:
            conns = dict(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the sender already went away
        for thread in conns.values():
            thread.join(timeout=_JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("tcp: receive thread %s did not stop in time", thread.name)
        with self._targets_lock:
            self._targets.clear()
        self._region_keys.clear()
