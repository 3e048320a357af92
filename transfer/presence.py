"""Member presence: the controller hears at once when a trainer rank's process is gone.

A trainer rank that dies cannot report, and the store (torch's `TCPStore`, in a process of its
own) tells nobody that a client's connection closed; before this, the other ranks and the
engines learned of a rank killed mid-update only when the update timed out. So every trainer
rank that does not host the controller holds one more connection, to the controller's presence
listener (on the control plane's host, at `ControlPlaneConfig.presence_port`, published sealed
under `presence`). After a handshake in which the member proves it holds the run's key (it
seals the listener's fresh challenge and its rank), nothing travels on it but a goodbye byte
when the member closes its sender. When it closes without that goodbye (the process died or was
killed: the kernel closes its sockets; or TCP keepalive, after about 5 s, found its host gone)
the controller fails the update in flight at once, naming the rank (`Controller` writes the
lost rank's failed reports and the update's `abort` key), and fails every later update the
same way.

The listener is one thread over a selector: O(1) work per member event, none per update.
Unproven connections are bounded (`_MAX_PENDING`, each with a handshake deadline); a stranger
without the token can neither register nor end a member's presence.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from weight_transfer.backends.base import (
    ControlPlaneAuthError,
    TransportTimeoutError,
    WeightTransferError,
)
from weight_transfer.control import ControlPlane
from weight_transfer.protocol import PresenceAddress

log = logging.getLogger(__name__)

PRESENCE_KEY = "presence"
"""Store key of the listener's address (`PresenceAddress`)."""
_PROOF_KEY = "presence/hello"
"""The store key a member's proof is sealed for (binds it to this use and run)."""
_CHALLENGE_BYTES = 16
_RANK = struct.Struct("!q")
_LENGTH = struct.Struct("!I")
_MAX_PROOF_BYTES = 4096
_MAX_PENDING = 32
"""Connections accepted but not yet proven; more are closed at once."""
_HANDSHAKE_S = 5.0
_ACK, _BYE = b"K", b"B"
_KEEPALIVE = (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3))
"""TCP keepalive (seconds idle, probe interval, probes): a host that vanishes without closing
its sockets is noticed after about 5 s."""


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Pending:
    """A connection in its handshake."""

    __slots__ = ("buf", "challenge", "deadline", "sock")

    def __init__(self, sock: socket.socket, challenge: bytes) -> None:
        self.sock = sock
        self.challenge = challenge
        self.deadline = time.monotonic() + _HANDSHAKE_S
        self.buf = b""


class PresenceListener:
    """The controller's side: hears trainer ranks' presence connections close.

    `on_gone(rank, why)` runs on the listener's thread when a proven member's connection closes
    (`why` names the rank and says whether it said goodbye); `on_present(rank)` when a rank
    proved itself (a rank that left may join again). Thread-safe to `close`.
    """

    def __init__(
        self,
        control: ControlPlane,
        port: int,
        num_ranks: int,
        on_gone: Callable[[int, str], None],
        on_present: Callable[[int], None],
    ) -> None:
        self._control = control
        self._num_ranks = num_ranks
        self._on_gone = on_gone
        self._on_present = on_present
        self._listener = socket.create_server((control.config.host, port), backlog=64)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pending: dict[socket.socket, _Pending] = {}
        self._members: dict[socket.socket, int] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wt-presence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, _ in self._sel.select(timeout=0.5):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        return
                    else:
                        self._readable(key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.deadline < now]:
                    log.warning("presence: a connection did not prove itself in time; closed")
                    self._drop(p.sock)
        except Exception:  # the thread must not die silently
            log.exception(
                "presence listener failed; trainer ranks lost from now on are noticed "
                "only at the update's timeout"
            )

    def _accept(self) -> None:
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._pending) >= _MAX_PENDING:
            log.warning(
                "presence: %d handshakes pending; closing a connection from %s", _MAX_PENDING, addr
            )
            sock.close()
            return
        challenge = os.urandom(_CHALLENGE_BYTES)
        try:
            sock.setblocking(False)
            sock.send(challenge)  # 16 bytes into an empty socket buffer
        except OSError:
            sock.close()
            return
        self._pending[sock] = _Pending(sock, challenge)
        self._sel.register(sock, selectors.EVENT_READ, "conn")

    def _readable(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        pending = self._pending.get(sock)
        if pending is not None:
            self._handshake(pending, data)
            return
        rank = self._members.get(sock)
        if rank is None:
            return
        if data and _BYE not in data:
            return  # nothing else is sent on a proven connection; ignore it
        self._drop(sock)
        if data:
            why = f"trainer rank {rank}: left (it closed its sender)"
            log.info("controller: %s", why)
        else:
            why = (
                f"trainer rank {rank}: lost (its connection to the controller closed without "
                "a goodbye: the process is gone, or its host is unreachable)"
            )
            log.error("controller: %s", why)
        self._on_gone(rank, why)

    def _handshake(self, p: _Pending, data: bytes) -> None:
        if not data:
            self._drop(p.sock)
            return
        p.buf += data
        if len(p.buf) < _LENGTH.size:
            return
        (n,) = _LENGTH.unpack_from(p.buf)
        if n > _MAX_PROOF_BYTES:
            log.warning("presence: a handshake claims %d bytes; closed", n)
            self._drop(p.sock)
            return
        if len(p.buf) < _LENGTH.size + n:
            return
        raw = p.buf[_LENGTH.size : _LENGTH.size + n]
        try:
            payload = self._control.unseal(self._control.full_key(_PROOF_KEY), raw)
        except ControlPlaneAuthError as exc:
            log.warning("presence: a connection failed authentication; closed: %s", exc)
            self._drop(p.sock)
            return
        rank = (
            _RANK.unpack(payload[_CHALLENGE_BYTES:])[0]
            if len(payload) == _CHALLENGE_BYTES + _RANK.size
            and payload[:_CHALLENGE_BYTES] == p.challenge
            else -1
        )
        if not 0 <= rank < self._num_ranks:
            log.warning("presence: a sealed handshake for another challenge or rank; closed")
            self._drop(p.sock)
            return
        del self._pending[p.sock]
        _keepalive(p.sock)
        try:
            p.sock.send(_ACK)
        except OSError:
            self._drop(p.sock)
            return
        self._members[p.sock] = rank
        self._on_present(rank)

    def _drop(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        self._members.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def close(self) -> None:
        """Stop listening and drop every connection (no member is reported gone)."""
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5.0)
        for sock in list(self._pending) + list(self._members):
            self._drop(sock)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()


class Presence:
    """A trainer rank's side: one connection to the controller's presence listener, held open
    until `close` (which says goodbye first).

    Raises:
        TransportTimeoutError: the listener did not answer within `timeout_s` (names the
            address and the setting to check).
        WeightTransferError: it refused the handshake.
    """

    def __init__(self, control: ControlPlane, rank: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        address = control.get(PRESENCE_KEY, PresenceAddress, timeout_s)
        host = control.config.host
        where = f"{host}:{address.port} (ControlPlaneConfig.presence_port)"
        try:
            sock = socket.create_connection((host, address.port), timeout=timeout_s)
        except OSError as exc:
            raise TransportTimeoutError(
                f"trainer rank {rank}: cannot reach the controller's presence listener at "
                f"{where}: {exc}"
            ) from exc
        try:
            challenge = self._read(sock, _CHALLENGE_BYTES, deadline)
            proof = control.seal(control.full_key(_PROOF_KEY), challenge + _RANK.pack(rank))
            sock.sendall(_LENGTH.pack(len(proof)) + proof)
            if self._read(sock, 1, deadline) != _ACK:
                raise WeightTransferError(
                    f"trainer rank {rank}: the controller's presence listener at {where} "
                    "refused the handshake"
                )
        except TimeoutError as exc:
            sock.close()
            raise TransportTimeoutError(
                f"trainer rank {rank}: the controller's presence listener at {where} did not "
                f"finish the handshake within {timeout_s:.0f} s"
            ) from exc
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise WeightTransferError(
                f"trainer rank {rank}: the controller's presence listener at {where} closed "
                f"the handshake: {exc}"
            ) from exc
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        _keepalive(sock)
        self._sock: socket.socket | None = sock

    @staticmethod
    def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
        out = b""
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed by the listener")
            out += chunk
        return out

    def close(self) -> None:
        """Say goodbye (the controller notes this rank left, not lost) and close."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            sock.sendall(_BYE)
        except OSError:
            pass  # the controller is gone already
        sock.close()
