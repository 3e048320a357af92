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
authentication and is reported (`ControlPlaneAuthError`). A stranger can still delete keys or
flood the store (the members then time out, naming what they waited for): firewall the port.

The store binds the configured host only (torch's TCPStore server would listen on every
interface: the listening socket is created here and handed over). Every wait has a timeout, and
losing the store's host (the controller) raises `PeerLostError` naming it.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

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
from weight_transfer.protocol import Go, Hello

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_NONCE_BYTES = 12
_TAG_BYTES = 16
_RUN_ID_BYTES = 16
PROTOCOL_VERSION = 3


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


def _open_store(
    config: ControlPlaneConfig, server: bool, listen_fd: int | None, timeout: datetime.timedelta
) -> dist.Store:
    """Construct the TCPStore, giving up after `config.timeout_s`.

    TCPStore's own timeout does not cover its handshake: a client pointed at a port held by
    something that accepts the connection but is not a store waits forever in the constructor.
    So the constructor runs on a daemon thread that is abandoned (left blocked) past the limit.
    """
    result: list[dist.Store] = []
    failure: list[BaseException] = []

    def construct() -> None:
        try:
            # torch's stubs omit TCPStore from torch.distributed's exports.
            result.append(
                dist.TCPStore(
                    config.host,
                    config.port,
                    is_master=server,
                    timeout=timeout,
                    wait_for_workers=False,
                    use_libuv=True,
                    master_listen_fd=listen_fd,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failure.append(exc)

    thread = threading.Thread(target=construct, name="wt-store-connect", daemon=True)
    thread.start()
    thread.join(config.timeout_s)
    if failure:
        raise failure[0]
    if not result:
        raise TimeoutError("no TCPStore answered there (is the port held by another program?)")
    return result[0]


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
        timeout = datetime.timedelta(seconds=config.timeout_s)
        try:
            listen_fd = None
            if server:
                # The store takes ownership of the descriptor (libuv closes it with the server).
                listen_fd = _listen(config.host, config.port).detach()
            try:
                self._store = _open_store(config, server, listen_fd, timeout)
            except BaseException:
                if listen_fd is not None:
                    os.close(listen_fd)
                raise
        except (RuntimeError, OSError, TimeoutError) as exc:
            what = "host" if server else "reach"
            raise TransportTimeoutError(
                f"{member}: could not {what} the control plane at {config.host}:{config.port} "
                f"within {config.timeout_s:.0f} s: {exc}"
            ) from exc
        full = self._prefix + "hello"
        if server:
            self.run_id = os.urandom(_RUN_ID_BYTES)
            hello = Hello(protocol=PROTOCOL_VERSION, session=config.session, run_id=self.run_id)
            nonce = os.urandom(_NONCE_BYTES)
            value = nonce + self._hello_aead.encrypt(nonce, codec.to_msgpack(hello), full.encode())
            self._call("publishing 'hello'", lambda: self._store.set(full, value))  # type: ignore[arg-type]
        else:
            self.wait(["hello"])
            raw = self._call("reading 'hello'", lambda: self._store.get(full))
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
            self.run_id = hello.run_id
        self._aead = AESGCM(derive_key(config.token, config.session, self.run_id))

    # -- members refused for their token -----------------------------------------------------

    _AUTH_FAILURES = "auth_failures"

    def _note_auth_failure(self) -> None:
        """Count a join refused for its token, so the controller can say so at once.

        A plain counter: anyone who reaches the port can raise it, which can only make the
        controller fail an update it would otherwise wait out (the port must be firewalled).
        """
        try:
            self._store.add(self._prefix + self._AUTH_FAILURES, 1)
        except (RuntimeError, dist.DistError):
            log.debug("%s: could not count the refused join", self.member)

    def auth_failures(self) -> int:
        """How many members were refused because they hold another token."""
        return int(
            self._call(
                "reading auth failures",
                lambda: self._store.add(self._prefix + self._AUTH_FAILURES, 0),
            )
        )

    # -- the store, with the controller's loss named -----------------------------------------

    def _call(self, what: str, fn: Callable[[], R]) -> R:
        """Run one store operation; a broken connection means the controller is gone."""
        if self._store is None:
            raise WeightTransferError(f"{self.member}: the control plane connection is closed")
        try:
            return fn()
        except dist.DistNetworkError as exc:
            raise PeerLostError(
                f"{self.member}: lost the controller (control plane at {self.config.host}:"
                f"{self.config.port}) during {what}: {exc}"
            ) from exc

    # -- encrypted, authenticated values ----------------------------------------------------

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

    def put(self, key: str, message: object) -> None:
        """Publish a message under `key` (overwrites)."""
        full = self._prefix + key
        value = self.seal(full, codec.to_msgpack(message))
        # Store.set takes bytes as well; torch's stubs declare only str.
        self._call(
            f"publishing {key!r}",
            lambda: self._store.set(full, value),  # type: ignore[arg-type]
        )

    def delete(self, key: str) -> None:
        """Remove `key` (missing keys are ignored)."""
        full = self._prefix + key
        self._call(f"deleting {key!r}", lambda: self._store.delete_key(full))

    def get(self, key: str, cls: type[T], timeout_s: float | None = None) -> T:
        """Wait for `key` and decode it as `cls`.

        Raises:
            TransportTimeoutError: the key did not appear in time (names the key and member).
            ControlPlaneAuthError: the MAC does not match (wrong token or tampering).
            ValueError: authenticated but not matching the schema.
        """
        full = self._prefix + key
        self.wait([key], timeout_s)
        raw = self._call(f"reading {key!r}", lambda: self._store.get(full))
        return codec.from_msgpack(cls, self.unseal(full, raw))

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        """Block until every key exists.

        Raises:
            TransportTimeoutError: naming the missing keys.
        """
        t = self.config.timeout_s if timeout_s is None else timeout_s
        full = [self._prefix + k for k in keys]
        try:
            self._call(
                f"waiting for {keys}",
                lambda: self._store.wait(full, datetime.timedelta(seconds=t)),
            )
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, WeightTransferError):
                raise
            missing = [k for k, f in zip(keys, full, strict=True) if not self.exists(k)]
            raise TransportTimeoutError(
                f"{self.member}: timed out after {t:.1f} s waiting for {missing or keys} "
                "on the control plane"
            ) from exc

    def wait_any(self, keys: list[str], timeout_s: float | None = None) -> str:
        """Block until one of `keys` exists; return it.

        Raises:
            TransportTimeoutError: none appeared in time.
        """
        t = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        delay = 0.0005
        while True:
            for k in keys:
                if self.exists(k):
                    return k
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"{self.member}: timed out after {t:.1f} s waiting for any of {keys} "
                    "on the control plane"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def barrier(self, name: str, count: int, index: int, timeout_s: float | None = None) -> None:
        """Block until members 0..`count`-1 have entered the barrier `name` (used once per
        name); this member is `index`. Each arrival is a sealed value: a stranger's write
        fails authentication instead of releasing the barrier early.

        Raises:
            TransportTimeoutError: not every member arrived in time (names the missing ones).
            ControlPlaneAuthError: an arrival was not sealed with this run's key.
        """
        if not 0 <= index < count:
            raise ValueError(f"barrier {name!r}: member index {index} not in [0, {count})")
        self.put(f"barrier/{name}/{index}", Go(step=index))
        keys = [f"barrier/{name}/{i}" for i in range(count)]
        self.wait(keys, timeout_s)
        for i, k in enumerate(keys):
            if self.get(k, Go, timeout_s).step != i:
                raise ControlPlaneAuthError(f"{self.member}: barrier arrival {k!r} was moved")

    def exists(self, key: str) -> bool:
        """True if `key` has been published."""
        full = self._prefix + key
        return bool(self._call(f"checking {key!r}", lambda: self._store.check([full])))

    def all_exist(self, keys: list[str]) -> bool:
        """True if every key has been published (one store round trip; never waits, so it
        serves polling loops, where a store wait that times out makes torch log warnings)."""
        full = [self._prefix + k for k in keys]
        return bool(self._call(f"checking {keys}", lambda: self._store.check(full)))

    def claim(self, key: str, message: object) -> tuple[bool, bytes]:
        """Atomically claim `key` with a sealed `message`; (True, b"") for the first claimant,
        else (False, the first claimant's authenticated payload).

        Raises:
            ControlPlaneAuthError: the key holds a value not sealed in this run (a stranger
                claimed it first), naming the key.
        """
        full = self._prefix + "claim/" + key
        mine = self.seal(full, codec.to_msgpack(message))
        got = self._call(
            f"claiming {key!r}",
            lambda: self._store.compare_set(full, "", mine),  # type: ignore[arg-type]
        )
        if got == mine:
            return True, b""
        return False, self.unseal(full, got)

    def close(self) -> None:
        """Drop the connection (the server's store lives until the process ends)."""
        self._store = None  # type: ignore[assignment]
