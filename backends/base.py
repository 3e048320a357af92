"""The Transport contract: memory registration and one-sided writes, shared by every backend.

This module is the only one that `planner/` and `transfer/` import from `backends/`. It holds
the contract (`Transport`), its small value types, the lazy backend table and the project's
exception hierarchy (one module, so every layer raises the same types).

Contract in one paragraph (the model is NIXL's BackendGuide): a transport registers local
memory and returns a `Region`; a region registered as a `TARGET` has a `RegionDescriptor`
whose bytes a peer needs to write into it. A transport publishes its endpoint as bytes and
connects to peers from theirs. `post_writes` never blocks on the network: it queues a batch of
one-sided writes to one peer and returns a `WriteHandle`; `poll` reports completion without
blocking, `wait` blocks with a timeout. There is no ordering between batches, nor between the
writes of one batch; a batch is complete when every byte of it is in the target's memory.
Methods are not thread-safe unless a backend says so: one thread drives one transport.

Failure and memory (the rule every backend keeps): from `post_writes` until the batch is
*settled* (`WriteHandle.settled`) the transport may read the batch's source memory and write
its target bytes. A batch settles when it completed (`poll` returned True), or when it failed
(`poll` raised) and has been *quiesced*: nothing the backend started for it is still running
(its copy thread is done with it, its network requests completed or were cancelled, its DMA
drained). A failure does not settle a batch by itself: after `poll` raised, later polls (or
`quiesce`, which waits for it, bounded) set `WriteHandle.quiesced` once the backend knows that
nothing reads the memory any more. Until then the caller must not reuse, free or deregister
the batch's source memory; one that gives up waiting keeps that memory quarantined. A failure
while posting is reported the same way: `post_writes` raises only before anything of the batch
was started (a bad op, a peer already known lost); later failures come from `poll`.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack
import torch

__all__ = [
    "BACKENDS",
    "ConfigurationError",
    "ControlPlaneAuthError",
    "MemoryKind",
    "PeerLostError",
    "PlanMismatchError",
    "PreparedWrites",
    "Region",
    "RegionDescriptor",
    "RegionRole",
    "Transport",
    "TransportCapabilities",
    "TransportConfig",
    "TransportError",
    "TransportTimeoutError",
    "TransportUnavailableError",
    "UpdateAbortedError",
    "WeightTransferError",
    "WriteHandle",
    "WriteOp",
    "create_transport",
    "load_backend",
]


log = logging.getLogger(__name__)

# Errors: re-exported from the neutral module `weight_transfer.errors`.
from weight_transfer.errors import (  # noqa: E402,F401
    ConfigurationError,
    ControlPlaneAuthError,
    PeerLostError,
    PlanMismatchError,
    TransportError,
    TransportTimeoutError,
    TransportUnavailableError,
    UpdateAbortedError,
    WeightTransferError,
)

# ---------------------------------------------------------------------------------------------
# Value types.
# ---------------------------------------------------------------------------------------------


class MemoryKind(str, enum.Enum):
    """Where registered memory lives."""

    HOST = "host"
    CUDA = "cuda"

    @staticmethod
    def of(tensor: torch.Tensor) -> MemoryKind:
        """The memory kind of a tensor's storage."""
        if tensor.device.type == "cpu":
            return MemoryKind.HOST
        if tensor.device.type == "cuda":
            return MemoryKind.CUDA
        raise ConfigurationError(f"unsupported device {tensor.device} (only cpu and cuda)")


class RegionRole(str, enum.Enum):
    """What a region is registered for.

    SOURCE regions are only read locally by `post_writes`. TARGET regions are written by peers
    and have a descriptor to publish; some backends do extra work for them (the loopback
    backend moves host memory into a named shared-memory segment, in place).
    """

    SOURCE = "source"
    TARGET = "target"


@dataclasses.dataclass(frozen=True, slots=True)
class TransportCapabilities:
    """What a backend can do on this host."""

    memory_kinds: frozenset[MemoryKind]
    """Memory kinds it can register (as source and target)."""
    one_sided: bool
    """True if the target runs no code of its own per write (RDMA, shared memory, CUDA IPC)."""
    cross_host: bool
    """True if peers may be on other hosts."""


_DESCRIPTOR_FIELDS = ("backend", "kind", "nbytes", "payload")


@dataclasses.dataclass(frozen=True, slots=True)
class RegionDescriptor:
    """What a peer needs to write into a TARGET region. Travels as plain bytes (msgpack).

    `payload` is backend-specific (a shared-memory name, a packed UCX rkey, a NIXL serialized
    descriptor, an rkey and address). Peers treat it as opaque.
    """

    backend: str
    kind: MemoryKind
    nbytes: int
    payload: bytes

    def to_bytes(self) -> bytes:
        """Encode as msgpack (never pickle)."""
        data: bytes = msgpack.packb(
            [self.backend, self.kind.value, self.nbytes, self.payload], use_bin_type=True
        )
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> RegionDescriptor:
        """Decode and schema-check bytes produced by `to_bytes`.

        Raises:
            ValueError: the bytes are not a valid descriptor.
        """
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"region descriptor is not valid msgpack: {exc}") from exc
        if not (isinstance(obj, list) and len(obj) == 4):
            raise ValueError("region descriptor must be a 4-element list")
        backend, kind, nbytes, payload = obj
        if not isinstance(backend, str) or not isinstance(payload, bytes):
            raise ValueError("region descriptor has a field of the wrong type")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"region descriptor has invalid nbytes {nbytes!r}")
        try:
            mkind = MemoryKind(kind)
        except ValueError as exc:
            raise ValueError(f"region descriptor has unknown memory kind {kind!r}") from exc
        return cls(backend=backend, kind=mkind, nbytes=nbytes, payload=payload)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Region:
    """A registered range of local memory. Owned by the transport that registered it.

    The memory itself stays owned by the caller (the tensor passed to `register`), who must keep
    it alive and in place until `deregister`.
    """

    region_id: int
    address: int
    nbytes: int
    kind: MemoryKind
    device_index: int | None
    role: RegionRole
    descriptor: RegionDescriptor | None
    """Set for TARGET regions; None for SOURCE regions."""
    tensor: torch.Tensor = dataclasses.field(repr=False)
    """The uint8 view the region covers; keeps the memory alive while registered."""

    @classmethod
    def of(
        cls,
        region_id: int,
        flat: torch.Tensor,
        role: RegionRole,
        descriptor: RegionDescriptor | None,
    ) -> Region:
        """The region covering all of `flat` (a contiguous uint8 tensor), as registered now.

        Read the address after any backend work that moves the memory (loopback's move into
        shared memory).
        """
        kind = MemoryKind.of(flat)
        return cls(
            region_id=region_id,
            address=flat.data_ptr(),
            nbytes=flat.numel(),
            kind=kind,
            device_index=flat.device.index if kind is MemoryKind.CUDA else None,
            role=role,
            descriptor=descriptor,
            tensor=flat,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class WriteOp:
    """One one-sided write: `nbytes` from `source` at `source_offset` to `target` at
    `target_offset`."""

    source: Region
    source_offset: int
    target: RegionDescriptor
    target_offset: int
    nbytes: int


@dataclasses.dataclass(eq=False, slots=True)
class WriteHandle:
    """A posted batch of writes to one peer. Poll it with `Transport.poll`."""

    handle_id: int
    peer: str
    num_ops: int
    nbytes: int
    posted_at: float
    done: bool = False
    error: BaseException | None = None
    quiesced: bool = False
    """After a failure: True once the transport reads none of the batch's memory any more and
    never will again (`Transport.poll` and `Transport.quiesce` set it)."""
    state: Any = None
    """Backend-private completion state."""

    @property
    def settled(self) -> bool:
        """The batch completed, or failed and was quiesced: only then may the memory it reads
        (its source ranges) be reused, freed or deregistered."""
        return self.done or (self.error is not None and self.quiesced)


@dataclasses.dataclass(eq=False, slots=True)
class PreparedWrites:
    """A batch of writes to one peer, checked once by `Transport.prepare_writes` and posted any
    number of times with `Transport.post_prepared` (the same batch every update)."""

    peer: str
    ops: tuple[WriteOp, ...]
    nbytes: int
    sources: tuple[Region, ...]
    """The distinct source regions (each must still be registered when posted)."""
    state: Any = None
    """Backend-private precomputed form."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TransportConfig:
    """Settings every backend understands; backend-specific ones live in `options`."""

    name: str = "loopback"
    """Backend name, a key of `BACKENDS`."""
    device_index: int | None = None
    """CUDA device this transport's process uses for GPU memory; None for host only."""
    connect_timeout_s: float = 30.0
    """How long `connect` waits for a peer."""
    listen_host: str = "127.0.0.1"
    """Address the backends that listen (tcp, ibverbs' bootstrap) bind; loopback by default.
    Configs resolve it per member (`weight_transfer.addresses.member_address`)."""
    advertise_host: str | None = None
    """Address this endpoint tells peers to connect to; None: `listen_host` (for a wildcard
    listen_host the tcp backend then advertises the host's name)."""
    options: tuple[tuple[str, str], ...] = ()
    """Backend-specific key/value strings (for example UCX transport lists)."""

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ConfigurationError(
                f"unknown transport {self.name!r}; choose one of {sorted(BACKENDS)}"
            )
        if self.connect_timeout_s <= 0:
            raise ConfigurationError("connect_timeout_s must be positive")
        if self.device_index is not None and self.device_index < 0:
            raise ConfigurationError("device_index must be >= 0")
        for key, value in self.options:
            if not key.strip():
                raise ConfigurationError(f"{self.name}: a transport option has an empty name")
            if not value.strip():
                # UCX, for one, takes an empty list and fails later, naming no option
                # ("ucp_init failed: No such element").
                raise ConfigurationError(
                    f"{self.name}: transport option {key!r} is empty: give it a value or leave "
                    "it out"
                )

    def option(self, key: str, default: str | None = None) -> str | None:
        """The value of a backend option, or `default`."""
        for k, v in self.options:
            if k == key:
                return v
        return default


# ---------------------------------------------------------------------------------------------
# The contract.
# ---------------------------------------------------------------------------------------------

_EVENT_WAIT_SLICE_S = 0.05
"""Longest `wait` sleeps on a completion event before it checks its deadline again."""


class Transport(ABC):
    """One process's endpoint of a one-sided write transport.

    Public methods check state and arguments once, then call the `_hook` a backend implements;
    backends never repeat these checks. Not thread-safe: drive one transport from one thread
    (the pipeline's write stage), except `endpoint()` and `capabilities`, which are immutable.
    """

    name: ClassVar[str]
    """Backend name, a key of `BACKENDS`."""
    progress_driven: ClassVar[bool] = False
    """True if data moves only inside `poll` (the backend progresses its engine there and has
    no thread of its own doing it, like UCX's `ucp_worker_progress`); `wait` then polls
    without sleeping. False for backends whose threads or hardware complete batches alone."""

    option_names: ClassVar[frozenset[str] | None] = frozenset()
    """The `TransportConfig.options` keys this backend takes; any other key is refused at
    construction. None: the backend checks its options itself (ucx passes UCX variables on)."""

    def __init__(self, config: TransportConfig) -> None:
        if self.option_names is not None:
            unknown = sorted(k for k, _ in config.options if k not in self.option_names)
            if unknown:
                known = ", ".join(sorted(self.option_names)) or "none"
                raise ConfigurationError(
                    f"{self.name}: unknown option(s) {', '.join(map(repr, unknown))}; "
                    f"this backend takes: {known}"
                )
        self.config = config
        self._regions: dict[int, Region] = {}
        self._peers: set[str] = set()
        self._region_ids = itertools.count(1)
        self._handle_ids = itertools.count(1)
        self._closed = False

    # -- properties -----------------------------------------------------------------------

    @property
    def capabilities(self) -> TransportCapabilities:
        """What this backend supports on this host."""
        return self._capabilities()

    @property
    def regions(self) -> list[Region]:
        """Regions currently registered, in registration order."""
        return list(self._regions.values())

    @property
    def peers(self) -> list[str]:
        """Names of connected peers."""
        return sorted(self._peers)

    # -- memory ---------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, *, role: RegionRole) -> Region:
        """Register the bytes of a contiguous tensor.

        Blocks until the memory is registered. The caller keeps ownership of the memory and
        must keep it alive and in place until `deregister`. For a TARGET region the returned
        region's `descriptor` is what peers need to write into it.

        Raises:
            ValueError: the tensor is not contiguous or is empty.
            TransportError: the backend cannot register this memory kind.
        """
        self._check_open()
        if not tensor.is_contiguous():
            raise ValueError("register() needs a contiguous tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("register() needs a non-empty tensor")
        kind = MemoryKind.of(tensor)
        if kind not in self.capabilities.memory_kinds:
            raise TransportError(
                f"transport {self.name!r} cannot register {kind.value} memory on this host"
            )
        flat = tensor.detach().view(-1).view(torch.uint8)
        region_id = next(self._region_ids)
        region = self._register(region_id, flat, role)
        self._regions[region.region_id] = region
        return region

    def deregister(self, region: Region) -> None:
        """Release a registration. Writes still in flight from or to it are the caller's fault."""
        self._check_open()
        if self._regions.pop(region.region_id, None) is None:
            raise ValueError(f"region {region.region_id} is not registered with this transport")
        self._deregister(region)

    # -- peers ----------------------------------------------------------------------------

    def endpoint(self) -> bytes:
        """This transport's address as bytes, for peers' `connect`."""
        self._check_open()
        return self._endpoint()

    def connect(self, peer: str, endpoint: bytes) -> None:
        """Connect to a peer, named `peer` in every later call and error message.

        Blocks until connected or `config.connect_timeout_s` passes.

        Raises:
            ValueError: `peer` is already connected, or the endpoint bytes are malformed.
            ConfigurationError: the backend cannot reach this peer (loopback across hosts).
            TransportTimeoutError: the peer did not answer in time.
            PeerLostError: the peer refused or vanished.
        """
        self._check_open()
        if not peer:
            raise ValueError("peer name must be non-empty")
        if peer in self._peers:
            raise ValueError(f"peer {peer!r} is already connected")
        self._connect(peer, bytes(endpoint))
        self._peers.add(peer)

    def disconnect(self, peer: str) -> None:
        """Drop a peer; posting to it afterwards raises."""
        self._check_open()
        self._check_peer(peer)
        self._peers.discard(peer)
        self._disconnect(peer)

    # -- writes ---------------------------------------------------------------------------

    def post_writes(self, peer: str, ops: Sequence[WriteOp]) -> WriteHandle:
        """Queue a batch of one-sided writes to `peer`. Never blocks on the network.

        Every op is checked before anything is queued: the source range must lie inside its
        registered region, the target range inside the descriptor's bytes, and the descriptor
        must belong to this backend. On any bad op nothing is written.

        Raises:
            ValueError: an op is out of bounds, refers to an unknown region, or carries a
                descriptor the backend's own payload checks refuse (named).
            PeerLostError: `peer` is not connected, or is already known to be dead.
        """
        self._check_open()
        self._check_peer(peer)
        total = self._check_ops(peer, ops)
        handle = self._new_handle(peer, len(ops), total)
        if not ops:
            handle.done = True
            return handle
        self._post_writes(peer, list(ops), handle)
        return handle

    def prepare_writes(self, peer: str, ops: Sequence[WriteOp]) -> PreparedWrites:
        """Check a batch that will be posted many times (every update) once, and let the
        backend precompute what posting it needs (loopback: a device copy table).

        Raises the same errors as `post_writes`, for the same reasons.
        """
        self._check_open()
        self._check_peer(peer)
        total = self._check_ops(peer, ops)
        sources = tuple({id(op.source): op.source for op in ops}.values())
        prepared = PreparedWrites(peer=peer, ops=tuple(ops), nbytes=total, sources=sources)
        self._prepare_writes(prepared)
        return prepared

    def post_prepared(self, prepared: PreparedWrites) -> WriteHandle:
        """Post a batch made by `prepare_writes`, as `post_writes(prepared.peer, prepared.ops)`
        would, without checking every op again.

        Raises:
            ValueError: a source region of the batch was deregistered since it was prepared.
            PeerLostError: the peer is not connected, or is already known to be dead.
        """
        self._check_open()
        self._check_peer(prepared.peer)
        for r in prepared.sources:
            if self._regions.get(r.region_id) is not r:
                raise ValueError(
                    f"prepared writes to {prepared.peer!r}: source region {r.region_id} was "
                    "deregistered since the batch was prepared"
                )
        handle = self._new_handle(prepared.peer, len(prepared.ops), prepared.nbytes)
        if not prepared.ops:
            handle.done = True
            return handle
        self._post_prepared(prepared, handle)
        return handle

    def mapped_view(
        self, peer: str, target: RegionDescriptor, offset: int, nbytes: int, device: torch.device
    ) -> torch.Tensor | None:
        """A uint8 tensor over `nbytes` of `target` at `offset` that kernels on `device` may
        write straight into (a peer's memory on the same GPU, mapped over CUDA IPC), or None
        where the backend cannot offer one (the default). Writing through it is a one-sided
        write whose completion is the writing kernel's: the caller orders its commit after it.

        Raises:
            ValueError: the range is outside the descriptor, or the descriptor is not this
                backend's.
        """
        self._check_open()
        self._check_peer(peer)
        if target.backend != self.name:
            raise ValueError(f"mapped view into {peer!r}: descriptor is for {target.backend!r}")
        if offset < 0 or nbytes <= 0 or offset + nbytes > target.nbytes:
            raise ValueError(
                f"mapped view into {peer!r}: range [{offset}, {offset + nbytes}) is outside "
                f"the remote region of {target.nbytes} bytes"
            )
        return self._mapped_view(peer, target, offset, nbytes, device)

    def _mapped_view(
        self, peer: str, target: RegionDescriptor, offset: int, nbytes: int, device: torch.device
    ) -> torch.Tensor | None:
        return None

    def _check_ops(self, peer: str, ops: Sequence[WriteOp]) -> int:
        total = 0
        for i, op in enumerate(ops):
            if op.nbytes <= 0:
                raise ValueError(f"write {i} to {peer!r}: nbytes must be positive, got {op.nbytes}")
            if self._regions.get(op.source.region_id) is not op.source:
                raise ValueError(
                    f"write {i} to {peer!r}: source region {op.source.region_id} is not "
                    "registered with this transport"
                )
            if op.source_offset < 0 or op.source_offset + op.nbytes > op.source.nbytes:
                raise ValueError(
                    f"write {i} to {peer!r}: source range [{op.source_offset}, "
                    f"{op.source_offset + op.nbytes}) is outside its region of "
                    f"{op.source.nbytes} bytes"
                )
            if op.target.backend != self.name:
                raise ValueError(
                    f"write {i} to {peer!r}: target descriptor is for backend "
                    f"{op.target.backend!r}, not {self.name!r}"
                )
            if op.target_offset < 0 or op.target_offset + op.nbytes > op.target.nbytes:
                raise ValueError(
                    f"write {i} to {peer!r}: target range [{op.target_offset}, "
                    f"{op.target_offset + op.nbytes}) is outside the remote region of "
                    f"{op.target.nbytes} bytes"
                )
            total += op.nbytes
        return total

    def _new_handle(self, peer: str, num_ops: int, nbytes: int) -> WriteHandle:
        return WriteHandle(
            handle_id=next(self._handle_ids),
            peer=peer,
            num_ops=num_ops,
            nbytes=nbytes,
            posted_at=time.monotonic(),
        )

    def poll(self, handle: WriteHandle) -> bool:
        """True once every write of the batch is complete. Never blocks.

        A failed batch is not settled until it is quiesced (module docstring): every poll
        after the failure raises the same error and first asks the backend, without
        blocking, whether the batch still runs; `handle.quiesced` says when it no longer does.

        Raises:
            TransportError / PeerLostError: the batch failed (raised on every poll after that).
        """
        if handle.error is not None:
            if not handle.quiesced and not self._closed:
                handle.quiesced = self._check_quiesced(handle)
            raise handle.error
        if handle.done:
            return True
        self._check_open()
        try:
            handle.done = self._poll(handle)
        except WeightTransferError as exc:
            handle.error = exc
            handle.quiesced = self._check_quiesced(handle)
            raise
        return handle.done

    def quiesce(self, handle: WriteHandle, timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, until the batch is settled (complete, or failed and no
        longer reading its memory); returns `handle.settled`. Never raises the batch's own
        error: this is the wait a caller makes after a failure, before reusing the memory.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.poll(handle):
                    return True
            except WeightTransferError:
                if handle.settled:
                    return True
            if time.monotonic() >= deadline:
                return handle.settled
            event = self.completion_event(handle)
            if event is not None:
                event.wait(0.01)
            elif not self.progress_driven:
                time.sleep(1e-4)

    def _check_quiesced(self, handle: WriteHandle) -> bool:
        try:
            return self._quiesce(handle)
        except WeightTransferError as exc:  # it may still run: keep it unsettled
            log.warning("%s: checking a failed batch to %r: %s", self.name, handle.peer, exc)
            return False

    def completion_event(self, handle: WriteHandle) -> threading.Event | None:
        """An event a background thread sets when the batch finishes (then `poll` it), or None
        when the batch already completed or failed, or the backend completes it only inside
        `poll`.

        Lets a caller that juggles many batches (the pipeline) sleep instead of spinning.
        """
        if handle.done or handle.error is not None:
            return None
        return self._completion_event(handle)

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Block until the batch completes.

        How it waits depends on the backend: if `_completion_event` gives an event (backends
        whose background threads complete batches: tcp, loopback's host copies), it sleeps on
        that event and uses no CPU; if the backend is `progress_driven` (data moves only while
        `poll` runs: ucx, nixl), it polls without sleeping; otherwise it polls with a short
        backoff (10 us doubling to 100 us).

        Raises:
            TransportTimeoutError: not complete after `timeout_s`, naming the peer.
        """
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        deadline = time.monotonic() + timeout_s
        event = self.completion_event(handle)
        backoff = 0.0
        while not self.poll(handle):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeoutError(
                    f"{self.name}: {handle.num_ops} write(s), {handle.nbytes} bytes to peer "
                    f"{handle.peer!r} not complete after {timeout_s:.1f} s"
                )
            if event is not None:
                if event.wait(min(remaining, _EVENT_WAIT_SLICE_S)):
                    event = None  # set: what remains (if anything) is polled below
                continue
            if self.progress_driven:
                continue  # every poll moves data; sleeping would only stall the transfer
            if backoff:
                time.sleep(backoff)
            backoff = min(backoff * 2 or 1e-5, 1e-4)

    def close(self) -> None:
        """Release every registration and connection. Idempotent."""
        if self._closed:
            return
        try:
            self._close()
        finally:
            self._closed = True
            self._regions.clear()
            self._peers.clear()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")

    def _check_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise PeerLostError(f"{self.name}: peer {peer!r} is not connected")

    # -- hooks a backend implements ---------------------------------------------------------

    @abstractmethod
    def _capabilities(self) -> TransportCapabilities: ...

    @abstractmethod
    def _register(self, region_id: int, flat: torch.Tensor, role: RegionRole) -> Region:
        """Register `flat` (a contiguous uint8 tensor); return the Region with `region_id`."""

    @abstractmethod
    def _deregister(self, region: Region) -> None: ...

    @abstractmethod
    def _endpoint(self) -> bytes: ...

    @abstractmethod
    def _connect(self, peer: str, endpoint: bytes) -> None: ...

    @abstractmethod
    def _disconnect(self, peer: str) -> None: ...

    @abstractmethod
    def _post_writes(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        """Queue already-checked ops; keep completion state in `handle.state`.

        Raise only before anything of the batch started; a failure after part of it was
        handed to the backend's machinery is kept in `handle.state` and raised by `_poll`,
        so that the caller can wait for the part that started (`_quiesce`)."""

    def _prepare_writes(self, prepared: PreparedWrites) -> None:
        """Precompute `prepared.state` for `_post_prepared` (default: nothing to keep)."""
        prepared.state = None

    def _post_prepared(self, prepared: PreparedWrites, handle: WriteHandle) -> None:
        """Post a prepared batch (default: as a fresh batch of the same ops)."""
        self._post_writes(prepared.peer, list(prepared.ops), handle)

    @abstractmethod
    def _poll(self, handle: WriteHandle) -> bool:
        """Return True when complete; raise a TransportError subclass on failure."""

    @abstractmethod
    def _close(self) -> None: ...

    def _quiesce(self, handle: WriteHandle) -> bool:
        """After `handle`'s batch failed: True once nothing the backend started for it still
        runs (so nothing reads its source memory or writes its target bytes any more). Never
        blocks: it is asked again on every later poll. It may progress or cancel the batch's
        outstanding work; it must not report True while any of it may still touch memory.

        The default, True, is right only for a backend whose `_poll` raises solely after the
        batch stopped (a backend with its own threads or outstanding requests overrides it).
        """
        return True

    def _completion_event(self, handle: WriteHandle) -> threading.Event | None:
        """An event that is set once `handle`'s batch completed or failed, or None.

        Optional: a backend whose own threads complete batches returns it so that `wait`
        sleeps on it instead of polling. After it is set, `wait` still calls `poll` (which
        reports the result); a backend may return None for batches it must poll (loopback
        batches with CUDA copies).
        """
        return None


# ---------------------------------------------------------------------------------------------
# Lazy backend table: importing the project never imports pyverbs, ucx or nixl.
# ---------------------------------------------------------------------------------------------

BACKENDS: dict[str, str] = {
    "loopback": "weight_transfer.backends.loopback:LoopbackTransport",
    "tcp": "weight_transfer.backends.tcp:TcpTransport",
    "ucx": "weight_transfer.backends.ucx:UcxTransport",
    "nixl": "weight_transfer.backends.nixl:NixlTransport",
    "ibverbs": "weight_transfer.backends.ibverbs:IbverbsTransport",
}
"""Backend name -> "module:Class", imported on first use."""

EXTRAS: dict[str, str] = {
    "ucx": "pip install 'libucx-cu13>=1.22,<1.23' (from a checkout of weight-transfer: "
    "pip install '.[ucx]')",
    "nixl": "pip install nixl-cu13==1.5.1 (from a checkout of weight-transfer: "
    "pip install '.[nixl]')",
    "ibverbs": "apt-get install python3-pyverbs (rdma-core); see docs/ibverbs.md",
}
"""How to install what each optional backend needs (the one place every hint comes from).
weight-transfer itself is not on PyPI, so a hint names the package to install, and the extra
for a checkout."""


def load_backend(name: str) -> type[Transport]:
    """Import and return the Transport class registered under `name`.

    Raises:
        ConfigurationError: `name` is not a known backend.
        TransportUnavailableError: its optional dependency is missing (the message names the
            extra to install).
    """
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown transport {name!r}; choose one of {sorted(BACKENDS)}"
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = EXTRAS.get(name, "")
        raise TransportUnavailableError(
            f"transport {name!r} is not available: {exc}"
            + (f"; install it with: {hint}" if hint else "")
        ) from exc
    cls = getattr(module, class_name)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"{target} is not a Transport subclass")
    return cls


def create_transport(config: TransportConfig) -> Transport:
    """Build the transport named by `config.name`."""
    return load_backend(config.name)(config)
