"""The control plane: encrypted, authenticated, schema-checked messages over a TCPStore.

Every value is `nonce || AES-256-GCM(key, nonce, msgpack(message), aad=run id || store key)`.
The controller draws a fresh random run id (128 bits) when it starts and publishes it in the
`hello` value, sealed under a key derived from the token alone; every other key of the run is
derived with HKDF-SHA256 from the token, salted with the run id, so a value recorded in an
earlier run with the same token (a `commit/k` that said ok) authenticates in no later run. The
token itself must carry at least 128 bits of randomness (`weight-transfer token` prints one), so
no dictionary attack on a sealed value is worth trying. A reader authenticates and decrypts
before decoding anything, then decodes with the message's schema (`planner.codec`), never
pickle: whoever reaches the port cannot run code, cannot read memory keys (region descriptors)
or manifests, and a member with the wrong token learns nothing and is refused on its first read.

Membership is sealed too: names are claimed with an atomic compare-and-set of a sealed value,
join slots likewise, and a barrier is one sealed arrival per member, so a stranger on the port
cannot pre-claim a name, inflate a slot count or release a barrier early; what it writes fails
authentication and is reported (`ControlPlaneAuthError`). Nothing is decided on a key's
existence: existence only wakes a waiter, which then reads and authenticates the value (and
checks that it is the expected member's, for the expected step). A stranger can still delete
keys or flood the store (the members then time out, naming what they waited for): firewall the
port.

Work per member per update is O(1): waits block in the store (`wait` on the keys, woken when
they are written), reports are read together (`collect`: one wait and one `multi_get` for all
ranks' keys), barriers are one arrival per member and one release written by member 0, and
nothing polls. A member that must wait for two things at once (a trainer rank watching for
another rank's failure while its writes run) opens a second connection (`clone`).
The store tells nobody that a member's connection closed; a trainer rank's death is heard
through a connection of its own to the controller (`weight_transfer.presence`).

The store binds the configured host only (torch's TCPStore server would listen on every
interface: the listening socket is created here and handed over) and runs in a process of its
own with bounded memory and connections (`weight_transfer.store`), so a stranger on the port
cannot take the training process down. Every wait has a timeout. Connecting (probe, torch's
client handshake on a second connection, reading `hello`) runs under one deadline of
`timeout_s`: torch's client waits for its handshake replies without one, so past the deadline
the connection is cut under it (`_ConnectDeadline`). Losing the store (the controller) raises
`PeerLostError` naming it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from weight_transfer.backends.base import (
    ControlPlaneAuthError,
    PeerLostError,
    TransportTimeoutError,
    WeightTransferError,
)
from weight_transfer.config import ControlPlaneConfig
from weight_transfer.planner import codec
from weight_transfer.protocol import BarrierRelease, Go, Hello
from weight_transfer.store import HostedStore, StoreLimits, host_store

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_NONCE_BYTES = 12
_TAG_BYTES = 16
_RUN_ID_BYTES = 16
PROTOCOL_VERSION = 4

MAX_VALUE_BYTES = 8 << 20
"""Largest value torch's TCPStore server accepts (its libuv backend's MAX_PAYLOAD_LEN); larger
ones are refused here, naming the key, instead of the server closing the connection."""
_MULTI_GET_KEYS = 64
"""Keys per `multi_get`: a stranger's values (8 MiB each at most) can make one read hold at most
this many of them."""
_REREAD_S = (0.005, 0.25)
"""Backoff (first, longest) for re-reading a key that holds a value failing authentication:
the member it belongs to may still overwrite a stranger's planted value."""
REQUESTS = {"get": 2, "multi_get": 2}
"""Store requests per client call where it is not one (the client waits for the keys first)."""


def derive_key(token: str, session: str, run_id: bytes) -> bytes:
    """The AES-256 key of one run of a control plane session: HKDF-SHA256 of the token,
    salted with the run id (empty for the `hello` key, which only carries the run id)."""
    hkdf = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=run_id or None,
        info=b"weight-transfer/v3/control/" + session.encode(),
    )
    return hkdf.derive(token.encode())


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on exactly `host` (TCPStore's own server binds every interface)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


# torch's TCPStore client opens with VALIDATE (query 0, a magic number), then PING (query 13, a
# nonce the server echoes), and waits for the echo without any timeout.
_VALIDATE = struct.pack("<BI", 0, 0x3C85F7CE)
_PING_QUERY = 13


def _probe(host: str, port: int, deadline: float) -> None:
    """Return once a TCPStore server answers the client's opening exchange at host:port.

    Retries a refused connection until `deadline` (the store may not be up yet). Bounded: no
    thread and no socket outlives the call.

    Raises:
        TimeoutError: nothing answered as a store before `deadline` (naming what was seen).
    """
    delay = 0.01
    seen = "nothing listens there"
    first = True
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not first:
            raise TimeoutError(seen)
        first = False
        try:
            with socket.create_connection((host, port), timeout=max(remaining, 0.01)) as sock:
                nonce = os.getpid() & 0xFFFFFFFF
                sock.sendall(_VALIDATE + struct.pack("<BI", _PING_QUERY, nonce))
                reply = b""
                while len(reply) < 4:
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    chunk = sock.recv(4 - len(reply))
                    if not chunk:
                        break
                    reply += chunk
                if reply == struct.pack("<I", nonce):
                    return
                seen = (
                    "something accepted the connection but does not answer as a TCPStore "
                    "(is the port held by another program?)"
                )
        except TimeoutError:
            seen = (
                "something accepted the connection but did not answer as a TCPStore in time "
                "(is the port held by another program?)"
            )
        except OSError as exc:
            seen = f"{exc.strerror or exc}"
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


def _connect(config: ControlPlaneConfig, guard: _ConnectDeadline) -> dist.Store:
    """A TCPStore client, constructed on the calling thread once a store answered (`_probe`).

    `guard` (entered) bounds it: the client's own opening exchange waits without a timeout, and
    only the deadline's watchdog ends it. Its timeout is the time left (torch retries a cut
    connection until then), its default timeout afterwards `config.timeout_s`.
    """
    _probe(config.host, config.port, guard.deadline)
    with guard.building():
        store = dist.TCPStore(
            config.host,
            config.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(guard.deadline - time.monotonic(), 0.05)),
            wait_for_workers=False,
            use_libuv=True,
        )
    store.set_timeout(datetime.timedelta(seconds=config.timeout_s))
    return store


_CONNECT_LOCKS: dict[tuple[str, int], threading.Lock] = {}
_CONNECT_LOCKS_GUARD = threading.Lock()
_CUT_EVERY_S = 0.05
"""How often the deadline's watchdog cuts again (torch retries a cut connection)."""


def _socket_inodes() -> dict[int, int]:
    """This process's sockets: inode -> one descriptor of it (Linux `/proc/self/fd`)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            st = os.stat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out.setdefault(st.st_ino, int(name))
    return out


def _plain_ip(ip: str) -> str:
    return ip.removeprefix("::ffff:")


class _ConnectDeadline:
    """One deadline for the whole of connecting to the store: probe, torch's client handshake
    (a second connection, whose VALIDATE and PING replies torch waits for without a timeout)
    and the first requests (reading `hello`).

    Something on the port that answered the probe can still go silent on the client's own
    connection, and torch's client would wait forever. So, while the `with` block runs, a
    watchdog thread waits for the deadline; if the block is still running then, it shuts down
    (`SHUT_RDWR`, through a duplicate of the descriptor: the socket itself is shut) the
    block's own connection to the store, so the blocked call returns with an error, and keeps
    doing so until the block ends (torch reconnects until its own timeout, the same deadline).
    `fired` then says so. Which sockets are the block's own: while the client is built
    (`building`, one at a time per store address in this process) every socket this process
    opened to the store's address since building began; afterwards the ones that were found
    so. On a system without `/proc/self/fd` nothing can be cut and the wait is torch's.
    """

    def __init__(self, host: str, port: int, deadline: float) -> None:
        self._host = host
        self._port = port
        self.deadline = deadline
        """`time.monotonic()` by which connecting ends."""
        self.fired = False
        """The deadline passed while the block ran (its connection may be cut)."""
        self._done = threading.Event()
        with _CONNECT_LOCKS_GUARD:
            self._address_lock = _CONNECT_LOCKS.setdefault((host, port), threading.Lock())
        self._state = threading.Lock()
        self._before: set[int] | None = None
        """Sockets that existed when building began (set while building)."""
        self._mine: set[int] = set()
        """The block's sockets to the store, found when building ended."""
        self._peers: set[str] = set()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _ConnectDeadline:
        infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        self._peers = {_plain_ip(str(info[4][0])) for info in infos}
        self._thread = threading.Thread(
            target=self._watch, name="wt-store-connect-deadline", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()  # it wakes on `_done` within `_CUT_EVERY_S`

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Around constructing the client: the sockets it opens are this block's own."""
        if not self._address_lock.acquire(timeout=max(0.0, self.deadline - time.monotonic())):
            raise TimeoutError(
                "another connection of this process to the store did not finish its handshake "
                "in time"
            )
        try:
            with self._state:
                self._before = set(_socket_inodes())
            try:
                yield
            finally:
                with self._state:
                    self._mine = self._scan(exclude=self._before)
                    self._before = None
        finally:
            self._address_lock.release()

    def _watch(self) -> None:
        if self._done.wait(max(0.0, self.deadline - time.monotonic())):
            return
        self.fired = True
        while not self._done.is_set():
            with self._state:  # while building, the address lock is held: no other connect
                if self._before is not None:
                    self._scan(exclude=self._before, shut=True)
                elif self._mine:
                    self._scan(only=self._mine, shut=True)
            self._done.wait(_CUT_EVERY_S)

    def _scan(
        self, *, exclude: set[int] | None = None, only: set[int] | None = None, shut: bool = False
    ) -> set[int]:
        """Inodes of this process's sockets connected to the store's address, but those in
        `exclude` or, with `only`, only those; with `shut`, each is shut down too."""
        found: set[int] = set()
        for inode, fd in _socket_inodes().items():
            if (exclude is not None and inode in exclude) or (
                only is not None and inode not in only
            ):
                continue
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue  # closed meanwhile
            try:
                # Checked on the duplicate: the number may have been reused since the scan.
                if os.fstat(sock.fileno()).st_ino != inode or sock.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                peer = sock.getpeername()
                if peer[1] != self._port or _plain_ip(str(peer[0])) not in self._peers:
                    continue
                found.add(inode)
                if shut:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected, or already shut
            finally:
                sock.close()
        return found


@dataclasses.dataclass(frozen=True, slots=True)
class Collected(Generic[T]):
    """What `ControlPlane.collect` found: authenticated values, and the keys that had none."""

    values: dict[str, T]
    """Key -> its authenticated, decoded value that `accept` took."""
    missing: list[str]
    """Keys never written by the deadline."""
    refused: dict[str, str]
    """Keys whose value failed authentication, decoding or `accept` at the deadline: why."""

    @property
    def complete(self) -> bool:
        """Every key has a value."""
        return not self.missing and not self.refused


class ControlPlane:
    """A member's connection to the store.

    The controller creates it with `server=True` (it hosts the store); everyone else joins as a
    client. Thread-safe for distinct keys (TCPStore clients are).
    """

    def __init__(self, config: ControlPlaneConfig, *, server: bool, member: str) -> None:
        """Connect (or host) and check the token.

        Args:
            config: where the store is, the token, timeouts.
            server: True for the single member that hosts the store.
            member: this member's name for error messages ("trainer3", "engine1", "controller").

        Raises:
            TransportTimeoutError: the store could not be reached within `config.timeout_s`.
            ControlPlaneAuthError: the store's members use another token.
        """
        self.config = config
        self.member = member
        self._hello_aead = AESGCM(derive_key(config.token, config.session, b""))
        self._prefix = f"wt/{config.session}/"
        self._lock = threading.Lock()
        self._op_lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        """Store requests this connection sent, by operation (`REQUESTS`)."""
        self._hosted: HostedStore | None = None
        self._store: dist.Store = None  # type: ignore[assignment]
        if server:
            try:
                # The store host takes the socket over (bound here: exactly this host). Its
                # start, once per process, is bounded on its own (it imports torch).
                self._hosted = host_store(
                    _listen(config.host, config.port),
                    config.host,
                    StoreLimits(
                        memory_bytes=config.store_memory_bytes,
                        max_connections=config.store_max_connections,
                    ),
                    config.timeout_s,
                )
            except (RuntimeError, OSError, TimeoutError) as exc:
                raise TransportTimeoutError(
                    f"{member}: could not host the control plane at {config.host}:"
                    f"{config.port} within {config.timeout_s:.0f} s: {exc}"
                ) from exc
        # One deadline for probe, handshake and `hello`, whatever the port's holder does.
        deadline = time.monotonic() + config.timeout_s
        guard = _ConnectDeadline(config.host, config.port, deadline)
        try:
            with guard:
                self._store = _connect(config, guard)
                self.run_id = self._greet(server, deadline)
            if guard.fired:
                raise TimeoutError("the deadline passed as the connection was made")
        except BaseException as exc:
            self._store = None  # type: ignore[assignment]
            if self._hosted is not None:
                self._hosted.stop()
                self._hosted = None
            stalled = guard.fired and isinstance(exc, (RuntimeError, OSError, TimeoutError))
            if stalled or (
                isinstance(exc, (RuntimeError, OSError, TimeoutError))
                and not isinstance(exc, WeightTransferError)
            ):
                why = (
                    "something answered the probe as a TCPStore, then did not finish the "
                    "client's handshake or answer its first requests in time (is the port held "
                    "by another program?)"
                    if stalled
                    else str(exc)
                )
                raise TransportTimeoutError(
                    f"{member}: could not reach the control plane at {config.host}:"
                    f"{config.port} within {config.timeout_s:.0f} s: {why}"
                ) from exc
            raise
        self._aead = AESGCM(derive_key(config.token, config.session, self.run_id))

    def _greet(self, server: bool, deadline: float) -> bytes:
        """Publish (the store's host) or read and check the sealed `hello`: the run id."""
        config, member = self.config, self.member
        full = self._prefix + "hello"
        if server:
            run_id = os.urandom(_RUN_ID_BYTES)
            hello = Hello(protocol=PROTOCOL_VERSION, session=config.session, run_id=run_id)
            nonce = os.urandom(_NONCE_BYTES)
            value = nonce + self._hello_aead.encrypt(nonce, codec.to_msgpack(hello), full.encode())
            self._call("publishing 'hello'", "set", lambda: self._store.set(full, value))  # type: ignore[arg-type]
            return run_id
        self.wait(["hello"], max(0.001, deadline - time.monotonic()))
        raw = self._call("reading 'hello'", "get", lambda: self._store.get(full))
        try:
            hello = codec.from_msgpack(Hello, self._open(self._hello_aead, full, b"", raw))
        except ControlPlaneAuthError:
            self._note_auth_failure()
            raise
        if hello.protocol != PROTOCOL_VERSION:
            raise WeightTransferError(
                f"{member}: control plane speaks protocol {hello.protocol}, "
                f"this process {PROTOCOL_VERSION}"
            )
        if len(hello.run_id) != _RUN_ID_BYTES:
            raise ControlPlaneAuthError(f"{member}: the control plane's run id is malformed")
        return hello.run_id

    def clone(self, member: str | None = None) -> ControlPlane:
        """Another connection to the same store and run (for a second thread that blocks in
        waits while this one is busy: a TCPStore connection serves one request at a time).

        Raises:
            TransportTimeoutError: the store could not be reached within the timeout.
        """
        other = object.__new__(ControlPlane)
        other.config = self.config
        other.member = member or self.member
        other._hello_aead = self._hello_aead
        other._prefix = self._prefix
        other._lock = threading.Lock()
        other._op_lock = threading.Lock()
        other.requests = collections.Counter()
        other._hosted = None
        deadline = time.monotonic() + self.config.timeout_s
        guard = _ConnectDeadline(self.config.host, self.config.port, deadline)
        try:
            with guard:
                other._store = _connect(self.config, guard)
            if guard.fired:
                raise TimeoutError(
                    "something answered the probe as a TCPStore, then did not finish the "
                    "client's handshake in time (is the port held by another program?)"
                )
        except (RuntimeError, OSError, TimeoutError) as exc:
            if guard.fired and not isinstance(exc, TimeoutError):
                exc = TimeoutError(
                    "something answered the probe as a TCPStore, then did not finish the "
                    f"client's handshake in time (is the port held by another program?): {exc}"
                )
            raise TransportTimeoutError(
                f"{other.member}: could not reach the control plane at {self.config.host}:"
                f"{self.config.port} within {self.config.timeout_s:.0f} s: {exc}"
            ) from exc
        other.run_id = self.run_id
        other._aead = self._aead
        return other

    # -- members refused for their token -----------------------------------------------------

    _AUTH_FAILURES = "auth_failures"

    def _note_auth_failure(self) -> None:
        """Count a join refused for its token, so the controller can say so at once.

        A plain counter: anyone who reaches the port can raise it, which can only make the
        controller fail an update it would otherwise wait out (the port must be firewalled).
        """
        try:
            self._count("add")
            self._store.add(self._prefix + self._AUTH_FAILURES, 1)
        except (RuntimeError, dist.DistError):
            log.debug("%s: could not count the refused join", self.member)

    def auth_failures(self) -> int:
        """How many members were refused because they hold another token."""
        return int(
            self._call(
                "reading auth failures",
                "add",
                lambda: self._store.add(self._prefix + self._AUTH_FAILURES, 0),
            )
        )

    # -- the store, with the controller's loss named -----------------------------------------

    def _count(self, op: str) -> None:
        with self._lock:
            self.requests[op] += REQUESTS.get(op, 1)

    def _call(self, what: str, op: str, fn: Callable[[], R]) -> R:
        """Run one store operation; a broken connection means the controller is gone."""
        if self._store is None:
            raise WeightTransferError(f"{self.member}: the control plane connection is closed")
        self._count(op)
        try:
            return fn()
        except dist.DistNetworkError as exc:
            raise PeerLostError(
                f"{self.member}: lost the controller (control plane at {self.config.host}:"
                f"{self.config.port}) during {what}: {exc}"
            ) from exc

    # -- encrypted, authenticated values ----------------------------------------------------

    def full_key(self, key: str) -> str:
        """The store key of `key` (under this session's prefix), as `seal` binds values to."""
        return self._prefix + key

    def seal(self, full_key: str, payload: bytes) -> bytes:
        """Encrypt and authenticate `payload` for the store key `full_key` in this run."""
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, payload, self.run_id + full_key.encode())

    def unseal(self, full_key: str, raw: bytes) -> bytes:
        """Authenticate and decrypt a stored value; the inverse of `seal`.

        Raises:
            ControlPlaneAuthError: too short, tampered with, moved from another key, recorded
                in another run, or sealed with another token.
        """
        return self._open(self._aead, full_key, self.run_id, raw)

    def _open(self, aead: AESGCM, full_key: str, run_id: bytes, raw: bytes) -> bytes:
        if len(raw) < _NONCE_BYTES + _TAG_BYTES:
            raise ControlPlaneAuthError(
                f"{self.member}: control message {full_key!r} is too short ({len(raw)} bytes)"
            )
        try:
            return aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], run_id + full_key.encode())
        except InvalidTag:
            raise ControlPlaneAuthError(
                f"{self.member}: control message {full_key!r} failed authentication: it was "
                "sealed with another token or in another run (the control plane's members do "
                "not share this token, or someone without it writes to the store)"
            ) from None

    def _sealed(self, key: str, message: object) -> tuple[str, bytes]:
        full = self._prefix + key
        value = self.seal(full, codec.to_msgpack(message))
        if len(value) > MAX_VALUE_BYTES:
            raise WeightTransferError(
                f"{self.member}: control message {key!r} is {len(value)} bytes, more than the "
                f"{MAX_VALUE_BYTES} the store accepts in one value"
            )
        return full, value

    def _decode(self, full: str, raw: bytes, cls: type[T]) -> T:
        return codec.from_msgpack(cls, self.unseal(full, raw))

    def put(self, key: str, message: object) -> None:
        """Publish a message under `key` (overwrites). One request; does not block."""
        full, value = self._sealed(key, message)
        # Store.set takes bytes as well; torch's stubs declare only str.
        self._call(
            f"publishing {key!r}",
            "set",
            lambda: self._store.set(full, value),  # type: ignore[arg-type]
        )

    def put_first(self, key: str, message: object, cls: type[T]) -> T | None:
        """Publish `message` under `key` unless a value is there already (atomic).

        Returns:
            None if this call wrote the value; else the value that was there, authenticated
            and decoded as `cls`.

        Raises:
            ControlPlaneAuthError: the value there is not sealed in this run (a stranger's).
        """
        full, mine = self._sealed(key, message)
        got = self._call(
            f"publishing {key!r}",
            "compare_set",
            lambda: self._store.compare_set(full, "", mine),  # type: ignore[arg-type]
        )
        if got == mine:
            return None
        return self._decode(full, got, cls)

    def delete(self, key: str) -> None:
        """Remove `key` (missing keys are ignored)."""
        full = self._prefix + key
        self._call(f"deleting {key!r}", "delete_key", lambda: self._store.delete_key(full))

    def put_many(self, items: Sequence[tuple[str, object]]) -> None:
        """Publish several messages in one request (overwrites). Does not block."""
        sealed = [self._sealed(k, m) for k, m in items]
        store: Any = self._store  # torch's stubs lack Store.multi_set

        def send(part: list[tuple[str, bytes]]) -> None:
            store.multi_set([f for f, _ in part], [v for _, v in part])

        for i in range(0, len(sealed), _MULTI_GET_KEYS):
            part = sealed[i : i + _MULTI_GET_KEYS]
            self._call(f"publishing {len(part)} keys", "multi_set", functools.partial(send, part))

    def get(self, key: str, cls: type[T], timeout_s: float | None = None) -> T:
        """Wait for `key` and decode it as `cls` (it blocks in the store: two requests).

        Raises:
            TransportTimeoutError: the key did not appear in time (names the key and member).
            ControlPlaneAuthError: the MAC does not match (wrong token or tampering).
            ValueError: authenticated but not matching the schema.
        """
        full = self._prefix + key
        t = self.config.timeout_s if timeout_s is None else timeout_s

        def read() -> bytes:
            # The client's own wait (inside get) runs with its default timeout: set it.
            with self._op_lock:
                self._store.set_timeout(datetime.timedelta(seconds=max(t, 1e-3)))
                return self._store.get(full)

        try:
            raw = self._call(f"waiting for [{key!r}]", "get", read)
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, WeightTransferError):
                raise
            raise TransportTimeoutError(
                f"{self.member}: timed out after {t:.1f} s waiting for [{key!r}] "
                "on the control plane"
            ) from exc
        return self._decode(full, raw, cls)

    def _wait(self, full: list[str], timeout_s: float, what: str) -> bool:
        """One blocking wait in the store for every key of `full`; False at the timeout."""
        try:
            self._call(
                what,
                "wait",
                lambda: self._store.wait(full, datetime.timedelta(seconds=max(timeout_s, 1e-3))),
            )
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, WeightTransferError):
                raise
            return False
        return True

    def ready(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Block until every key exists (True) or `timeout_s` passes (False). One request."""
        return self._wait([self._prefix + k for k in keys], timeout_s, f"waiting for {keys}")

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        """Block until every key exists (one request; it blocks in the store).

        Raises:
            TransportTimeoutError: naming the missing keys.
        """
        t = self.config.timeout_s if timeout_s is None else timeout_s
        full = [self._prefix + k for k in keys]
        if not self._wait(full, t, f"waiting for {keys}"):
            missing = [k for k in keys if not self.exists(k)]
            raise TransportTimeoutError(
                f"{self.member}: timed out after {t:.1f} s waiting for {missing or keys} "
                "on the control plane"
            )

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """The raw values of keys that exist (`_MULTI_GET_KEYS` per request).

        Raises:
            TransportTimeoutError: a key vanished (deleted) before it was read.
        """
        out: list[bytes] = []
        full = [self._prefix + k for k in keys]

        def read(part: list[str]) -> list[bytes]:
            # multi_get first waits for its keys with the client's default timeout: the keys
            # exist, so make that wait short in case one was deleted meanwhile.
            with self._op_lock:
                self._store.set_timeout(datetime.timedelta(seconds=1.0))
                return list(self._store.multi_get(part))

        for i in range(0, len(full), _MULTI_GET_KEYS):
            part = full[i : i + _MULTI_GET_KEYS]
            try:
                out += self._call(
                    f"reading {len(part)} keys", "multi_get", functools.partial(read, part)
                )
            except (RuntimeError, dist.DistError) as exc:
                if isinstance(exc, WeightTransferError):
                    raise
                raise TransportTimeoutError(
                    f"{self.member}: key(s) {keys[i : i + _MULTI_GET_KEYS]} vanished from the "
                    "control plane while being read (deleted by someone on the port?)"
                ) from exc
        return out

    def collect(
        self,
        keys: Sequence[str],
        cls: type[T],
        timeout_s: float,
        *,
        accept: Callable[[str, T], bool] | None = None,
        name_missing: bool = True,
    ) -> Collected[T]:
        """Wait for every key, then read and authenticate them together.

        One blocking wait for all keys and one `multi_get` per `_MULTI_GET_KEYS` of them. A key
        whose value fails authentication, the schema or `accept` (say, a report naming another
        rank or step) is read again with a backoff until the deadline: its member may still
        overwrite what a stranger planted. Nothing is taken from a key's existence alone.

        Args:
            accept: checks an authenticated value for its key (the expected member and step).
            name_missing: at the deadline, find which keys are missing (one request per key;
                False for a caller that waits in slices and only wants to know "not yet").

        Returns:
            What was found by the deadline: `complete` when every key has an accepted value.
        """
        deadline = time.monotonic() + timeout_s
        pending = list(keys)
        values: dict[str, T] = {}
        refused: dict[str, str] = {}
        delay = _REREAD_S[0]
        while pending:
            if not self.ready(pending, max(0.0, deadline - time.monotonic())):
                break
            refused = {}
            for k, raw in zip(pending, self.read_many(pending), strict=True):
                try:
                    v = self._decode(self._prefix + k, raw, cls)
                except (ControlPlaneAuthError, ValueError) as exc:
                    refused[k] = str(exc)
                    continue
                if accept is not None and not accept(k, v):
                    refused[k] = f"{self.member}: {k!r} holds an authentic value for another member"
                    continue
                values[k] = v
            pending = list(refused)
            if pending:
                if time.monotonic() + delay > deadline:
                    break
                time.sleep(delay)
                delay = min(delay * 2, _REREAD_S[1])
        missing = [k for k in pending if k not in refused]
        if missing and name_missing:
            present = [k for k in missing if self.exists(k)]
            if present:  # written after the wait gave up: read them once
                late = self.collect(present, cls, 0.0, accept=accept, name_missing=False)
                values.update(late.values)
                refused.update(late.refused)
            missing = [k for k in missing if k not in values and k not in refused]
        elif missing:
            missing = [k for k in missing if k not in values]
        return Collected(values=values, missing=missing, refused=refused)

    def barrier(self, name: str, count: int, index: int, timeout_s: float | None = None) -> None:
        """Block until members 0..`count`-1 have entered the barrier `name` (used once per
        name); this member is `index`.

        Member i > 0 publishes one sealed arrival and blocks on member 0's sealed release;
        member 0 collects the arrivals (one wait, one read per 64 members), checks each is
        the expected member's, and publishes the release, or a failure naming the members
        missing or not authentic, which every member raises. A stranger's write can neither
        release the barrier early nor count as an arrival.

        Raises:
            TransportTimeoutError: not every member arrived in time (names the missing ones).
            ControlPlaneAuthError: an arrival was not sealed with this run's key.
        """
        if not 0 <= index < count:
            raise ValueError(f"barrier {name!r}: member index {index} not in [0, {count})")
        t = self.config.timeout_s if timeout_s is None else timeout_s
        release_key = f"barrier/{name}/release"
        if index > 0:
            self.put(f"barrier/{name}/{index}", Go(step=index))
            release = self.get(release_key, BarrierRelease, t)
        else:
            keys = {f"barrier/{name}/{i}": i for i in range(1, count)}
            got = self.collect(list(keys), Go, t, accept=lambda k, v: v.step == keys[k])
            error = ""
            if got.refused:
                error = (
                    f"barrier {name!r}: arrival(s) {sorted(got.refused)} failed authentication: "
                    + next(iter(got.refused.values()))
                )
            elif got.missing:
                error = f"barrier {name!r}: no arrival from {got.missing} within {t:.1f} s"
            release = BarrierRelease(ok=not error, error=error, forged=bool(got.refused))
            if count > 1:
                self.put(release_key, release)
        if release.ok:
            return
        who = f"{self.member}: "
        if release.forged:
            raise ControlPlaneAuthError(who + release.error)
        raise TransportTimeoutError(who + release.error)

    def exists(self, key: str) -> bool:
        """True if `key` has been published (a hint only: nothing is decided on it)."""
        full = self._prefix + key
        return bool(self._call(f"checking {key!r}", "check", lambda: self._store.check([full])))

    def claim(self, key: str, message: object) -> tuple[bool, bytes | None]:
        """Atomically claim `key` with a sealed `message`.

        Returns:
            (True, b"") for the first claimant; (False, the first claimant's authenticated
            payload) if a member holds it; (False, None) if the key holds a value that is not
            sealed in this run (a stranger's): it is nobody's claim, but taken.
        """
        full = self._prefix + "claim/" + key
        mine = self.seal(full, codec.to_msgpack(message))
        got = self._call(
            f"claiming {key!r}",
            "compare_set",
            lambda: self._store.compare_set(full, "", mine),  # type: ignore[arg-type]
        )
        if got == mine:
            return True, b""
        try:
            return False, self.unseal(full, got)
        except ControlPlaneAuthError:
            log.warning(
                "%s: %r holds a value not sealed in this run (a stranger's)", self.member, full
            )
            return False, None

    def close(self) -> None:
        """Drop the connection; the member hosting the store also stops it (the port closes
        and every other member's next request fails naming the lost controller)."""
        self._store = None  # type: ignore[assignment]
        if self._hosted is not None:
            self._hosted.stop()
            self._hosted = None
