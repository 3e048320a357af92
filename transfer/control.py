"""The control plane: authenticated, schema-checked messages over torch.distributed's TCPStore.

Every value is `msgpack(message) || HMAC-SHA256(token, key || msgpack)`. A reader checks the MAC
before decoding anything, then decodes with the message's schema (`planner.codec`), never
pickle: whoever reaches the port cannot run code, and a member with the wrong token learns
nothing it could act on and is refused on its first read. Every wait has a timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import time
from typing import TypeVar

import torch.distributed as dist

from backends.base import ControlPlaneAuthError, TransportTimeoutError, WeightTransferError
from planner import codec
from transfer.config import ControlPlaneConfig
from transfer.protocol import Hello

log = logging.getLogger(__name__)

T = TypeVar("T")

_MAC_BYTES = 32
PROTOCOL_VERSION = 1


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
        self._key = hashlib.sha256(b"weight-transfer/v1/" + config.token.encode()).digest()
        self._prefix = f"wt/{config.session}/"
        timeout = datetime.timedelta(seconds=config.timeout_s)
        try:
            self._store = dist.TCPStore(
                config.host,
                config.port,
                is_master=server,
                timeout=timeout,
                wait_for_workers=False,
                use_libuv=True,
            )
        except (RuntimeError, OSError) as exc:
            what = "host" if server else "reach"
            raise TransportTimeoutError(
                f"{member}: could not {what} the control plane at {config.host}:{config.port} "
                f"within {config.timeout_s:.0f} s: {exc}"
            ) from exc
        if server:
            self.put("hello", Hello(protocol=PROTOCOL_VERSION, session=config.session))
        else:
            hello = self.get("hello", Hello)
            if hello.protocol != PROTOCOL_VERSION:
                raise WeightTransferError(
                    f"{member}: control plane speaks protocol {hello.protocol}, "
                    f"this process {PROTOCOL_VERSION}"
                )

    # -- raw authenticated values -----------------------------------------------------------

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\x00" + payload, hashlib.sha256).digest()

    def put(self, key: str, message: object) -> None:
        """Publish a message under `key` (overwrites)."""
        payload = codec.to_msgpack(message)
        full = self._prefix + key
        self._store.set(full, payload + self._mac(full, payload))

    def get(self, key: str, cls: type[T], timeout_s: float | None = None) -> T:
        """Wait for `key` and decode it as `cls`.

        Raises:
            TransportTimeoutError: the key did not appear in time (names the key and member).
            ControlPlaneAuthError: the MAC does not match (wrong token or tampering).
            ValueError: authenticated but not matching the schema.
        """
        full = self._prefix + key
        self.wait([key], timeout_s)
        raw = self._store.get(full)
        if len(raw) < _MAC_BYTES:
            raise ControlPlaneAuthError(f"{self.member}: control message {key!r} is too short")
        payload, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(full, payload)):
            raise ControlPlaneAuthError(
                f"{self.member}: control message {key!r} failed authentication: the control "
                "plane's members do not share this token"
            )
        return codec.from_msgpack(cls, payload)

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        """Block until every key exists.

        Raises:
            TransportTimeoutError: naming the missing keys.
        """
        t = self.config.timeout_s if timeout_s is None else timeout_s
        full = [self._prefix + k for k in keys]
        try:
            self._store.wait(full, datetime.timedelta(seconds=t))
        except (RuntimeError, dist.DistError) as exc:
            missing = [k for k, f in zip(keys, full, strict=True) if not self._store.check([f])]
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
                if self._store.check([self._prefix + k]):
                    return k
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"{self.member}: timed out after {t:.1f} s waiting for any of {keys} "
                    "on the control plane"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def barrier(self, name: str, count: int, timeout_s: float | None = None) -> None:
        """Block until `count` members have entered the barrier `name` (used once per name).

        Raises:
            TransportTimeoutError: fewer than `count` arrived in time.
        """
        self.add(f"barrier/{name}", 1)
        t = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        delay = 0.0005
        while self.add(f"barrier/{name}", 0) < count:
            if time.monotonic() > deadline:
                n = self.add(f"barrier/{name}", 0)
                raise TransportTimeoutError(
                    f"{self.member}: barrier {name!r}: {n} of {count} members arrived in {t:.1f} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def exists(self, key: str) -> bool:
        """True if `key` has been published."""
        return bool(self._store.check([self._prefix + key]))

    def claim(self, key: str) -> bool:
        """Atomically claim a name; True for the first claimant only."""
        return int(self._store.add(self._prefix + "claim/" + key, 1)) == 1

    def add(self, key: str, amount: int) -> int:
        """Atomic counter (unauthenticated: use only for counts, never for decisions on data)."""
        return int(self._store.add(self._prefix + "count/" + key, amount))

    def poll_until(self, key: str, cls: type[T], deadline: float) -> T:
        """Like `get`, with an absolute monotonic deadline."""
        return self.get(key, cls, max(0.001, deadline - time.monotonic()))

    def close(self) -> None:
        """Drop the connection (the server's store lives until the process ends)."""
        self._store = None  # type: ignore[assignment]
