"""UCX backend: one-sided `ucp_put_nbx` into peers' memory with packed remote keys.

libucp comes from the `libucx-cu13` wheel through a small ctypes binding
(`backends.ucx_native`); ucx-py is no longer installable and ucxx exposes no RMA to Python.

How a write travels: the target registers its memory with `ucp_mem_map` (host memory, or
`UCS_MEMORY_TYPE_CUDA` for GPU memory) and publishes the packed rkey plus the address in the
region descriptor. The initiator unpacks the rkey once per (peer, region), posts one
`ucp_put_nbx` per write, then one `ucp_ep_flush_nbx`; the batch is complete when the flush
completes, which UCX guarantees only after every earlier put on that endpoint is remotely
complete. The target runs no code: on one host UCX moves host memory with `cma`
(process_vm_writev) and GPU memory with `cuda_ipc`; across hosts it uses RDMA where present.

Options (`TransportConfig.options`): every key is a UCX configuration variable, with or
without the `UCX_` prefix (`("TLS", "sm,cma,tcp")`, `("NET_DEVICES", "lo")`), applied with
`ucp_config_modify`; the library never reads the environment itself (UCX still honours `UCX_*`
variables that the process already has, as `ucp_config_read` always does). If
`NET_DEVICES` is not given and `config.listen_host` is a loopback address (the default), the
backend sets `NET_DEVICES=lo`, so a default transport never sends a packet off this host.

Failure model: endpoints use `UCP_ERR_HANDLING_MODE_NONE`, because asking UCX for peer error
handling turns puts into slow software emulation. UCX therefore never reports a dead peer;
a batch to a peer that died simply never completes, and `Transport.wait`'s timeout is what
detects it (`TransportTimeoutError` naming the peer). Over plain `tcp` lanes UCX emulates puts
with messages that the target's worker must progress; this backend does not progress targets,
so use transports with real one-sided lanes (cma, cuda_ipc, rc/dc) — the defaults on one host.

Not thread-safe (the UCX worker is single-threaded), like every `Transport`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import time

import msgpack
import torch

from backends.base import (
    MemoryKind,
    PeerLostError,
    Region,
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportCapabilities,
    TransportConfig,
    TransportError,
    TransportUnavailableError,
    WriteHandle,
    WriteOp,
)

__all__ = ["UcxTransport"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'weight-transfer[ucx]'"
_PAGE_BYTES = 4096
_CLOSE_TIMEOUT_S = 5.0
_POLL_BUDGET_S = 0.004

try:  # the binding module itself imports only ctypes; libucp is loaded in the constructor
    from backends import ucx_native
except ImportError as exc:  # pragma: no cover - the package ships with the project
    raise ImportError(f"backends.ucx_native is missing: {exc}") from exc


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prefault(flat: torch.Tensor) -> None:
    """Touch every page of host memory with a write of its own bytes, keeping the contents.

    A page that was never written is the shared zero page (or absent); a remote write into it
    would take a page fault in the kernel copy on every first touch. Rewriting one byte per
    page makes the mapping private and resident before the first update.
    """
    if flat.device.type != "cpu":
        return
    stride = flat[::_PAGE_BYTES]
    stride.copy_(stride.clone())


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    base: int
    nbytes: int
    rkey: int


@dataclasses.dataclass(slots=True)
class _Peer:
    name: str
    token: bytes
    ep: int
    targets: dict[bytes, _Target] = dataclasses.field(default_factory=dict)
    """This peer's regions with their unpacked rkeys, by descriptor payload."""


@dataclasses.dataclass(slots=True)
class _RegionState:
    memh: int
    cuda: bool


@dataclasses.dataclass(slots=True)
class _Batch:
    puts: list[ucx_native.Request]
    flush: ucx_native.Request | None


def _encode_payload(token: bytes, address: int, nbytes: int, rkey: bytes) -> bytes:
    return msgpack.packb([token, address, nbytes, rkey], use_bin_type=True)


def _decode_payload(payload: bytes) -> tuple[bytes, int, int, bytes]:
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"ucx region payload is not valid msgpack: {exc}") from exc
    if not (
        isinstance(obj, list)
        and len(obj) == 4
        and isinstance(obj[0], bytes)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in obj[1:3])
        and isinstance(obj[3], bytes)
    ):
        raise ValueError(
            "ucx region payload must be [token: bytes, address: int, nbytes: int, rkey: bytes]"
        )
    return obj[0], obj[1], obj[2], obj[3]


class UcxTransport(Transport):
    """UCX one-sided puts (libucp via ctypes). See the module docstring for the options.

    Raises (constructor):
        TransportUnavailableError: the `libucx` wheel is missing or libucp cannot start.
    """

    name = "ucx"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        options = list(config.options)
        keys = {k[4:] if k.startswith("UCX_") else k for k, _ in options}
        if "NET_DEVICES" not in keys and _is_loopback(config.listen_host):
            options.append(("NET_DEVICES", "lo"))
        self._cuda = config.device_index is not None and torch.cuda.is_available()
        if self._cuda:
            # UCX's CUDA transports work on the calling thread's current device.
            torch.cuda.set_device(config.device_index)
        try:
            self._worker = ucx_native.UcxWorker(options, name=f"wt-{os.getpid()}")
        except ImportError as exc:
            raise TransportUnavailableError(
                f"transport 'ucx' needs the libucx wheel ({exc}); install it with: {_INSTALL_HINT}"
            ) from exc
        except OSError as exc:
            raise TransportUnavailableError(
                f"transport 'ucx' could not load libucp ({exc}); reinstall with: {_INSTALL_HINT}"
            ) from exc
        except ucx_native.UcxError as exc:
            raise TransportUnavailableError(f"transport 'ucx' could not start UCX: {exc}") from exc
        self._token = os.urandom(16)
        self._address = self._worker.address()
        self._region_state: dict[int, _RegionState] = {}
        self._by_peer: dict[str, _Peer] = {}
        logger.debug("ucx transport up: libucp %s, options %s", self._worker.lib.version(), options)

    # -- hooks ----------------------------------------------------------------------------

    def _capabilities(self) -> TransportCapabilities:
        kinds = {MemoryKind.HOST}
        if self._cuda:
            kinds.add(MemoryKind.CUDA)
        return TransportCapabilities(memory_kinds=frozenset(kinds), one_sided=True, cross_host=True)

    def _register(self, region_id: int, flat: torch.Tensor, role: RegionRole) -> Region:
        kind = MemoryKind.of(flat)
        cuda = kind is MemoryKind.CUDA
        prefault(flat)
        memh = self._worker.mem_map(flat.data_ptr(), flat.numel(), cuda=cuda)
        descriptor = None
        if role is RegionRole.TARGET:
            try:
                rkey = self._worker.rkey_pack(memh)
            except ucx_native.UcxError:
                self._worker.mem_unmap(memh)
                raise
            descriptor = RegionDescriptor(
                backend=self.name,
                kind=kind,
                nbytes=flat.numel(),
                payload=_encode_payload(self._token, flat.data_ptr(), flat.numel(), rkey),
            )
        self._region_state[region_id] = _RegionState(memh=memh, cuda=cuda)
        return Region(
            region_id=region_id,
            address=flat.data_ptr(),
            nbytes=flat.numel(),
            kind=kind,
            device_index=flat.device.index if cuda else None,
            role=role,
            descriptor=descriptor,
            tensor=flat,
        )

    def _deregister(self, region: Region) -> None:
        state = self._region_state.pop(region.region_id)
        self._worker.mem_unmap(state.memh)

    def _endpoint(self) -> bytes:
        return msgpack.packb([self._token, self._address], use_bin_type=True)

    def _connect(self, peer: str, endpoint: bytes) -> None:
        try:
            obj = msgpack.unpackb(endpoint, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"ucx endpoint of peer {peer!r} is not valid msgpack: {exc}") from exc
        if not (
            isinstance(obj, list)
            and len(obj) == 2
            and isinstance(obj[0], bytes)
            and isinstance(obj[1], bytes)
        ):
            raise ValueError(f"ucx endpoint of peer {peer!r} is malformed")
        token, address = obj
        try:
            ep = self._worker.ep_create(address)
        except ucx_native.UcxError as exc:
            raise PeerLostError(f"ucx: cannot reach peer {peer!r}: {exc}") from exc
        self._by_peer[peer] = _Peer(name=peer, token=token, ep=ep)

    def _disconnect(self, peer: str) -> None:
        self._drop_peer(self._by_peer.pop(peer))

    def _post_writes(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        state = self._by_peer[peer]
        resolved: list[tuple[int, int, _RegionState, int]] = []
        for i, op in enumerate(ops):  # resolve everything before posting anything
            target = state.targets.get(op.target.payload)
            if target is None:
                token, base, length, packed = _decode_payload(op.target.payload)
                if token != state.token:
                    raise ValueError(
                        f"write {i} to {peer!r}: the target region belongs to another ucx "
                        f"endpoint, not to peer {peer!r}"
                    )
                try:
                    rkey = self._worker.rkey_unpack(state.ep, packed)
                except ucx_native.UcxError as exc:
                    raise TransportError(
                        f"ucx: write {i} to {peer!r}: cannot unpack the target's rkey: {exc}"
                    ) from exc
                target = _Target(base=base, nbytes=length, rkey=rkey)
                state.targets[op.target.payload] = target
            if op.target_offset + op.nbytes > target.nbytes:
                # The payload holds what the target registered; a descriptor whose `nbytes`
                # was altered must not let a write run past the registration.
                raise ValueError(
                    f"write {i} to {peer!r}: target range [{op.target_offset}, "
                    f"{op.target_offset + op.nbytes}) is outside the {target.nbytes} bytes the "
                    f"peer registered (the descriptor claims {op.target.nbytes})"
                )
            resolved.append(
                (
                    op.source.address + op.source_offset,
                    target.base + op.target_offset,
                    self._region_state[op.source.region_id],
                    target.rkey,
                )
            )
        puts: list[ucx_native.Request] = []
        try:
            for (local, remote, src, rkey), op in zip(resolved, ops, strict=True):
                req = self._worker.put(
                    state.ep, local, op.nbytes, remote, rkey, src.memh, cuda=src.cuda
                )
                if req.ptr is not None:
                    puts.append(req)
            flush = self._worker.flush(state.ep)
        except ucx_native.UcxError as exc:
            for req in puts:
                self._worker.release(req)
            raise TransportError(f"ucx: posting writes to {peer!r} failed: {exc}") from exc
        handle.state = _Batch(puts=puts, flush=flush)

    def _poll(self, handle: WriteHandle) -> bool:
        batch: _Batch = handle.state
        # UCX moves a large put in fragments, one step per progress call, and cma copies each
        # fragment inline. Progress while there is work, for at most _POLL_BUDGET_S, so a poll
        # advances a batch by megabytes (callers sleep between polls) yet stays short.
        deadline = time.perf_counter() + _POLL_BUDGET_S
        while self._worker.progress() and time.perf_counter() < deadline:
            pass
        try:
            batch.puts = [req for req in batch.puts if not self._worker.check(req)]
            if batch.flush is not None and self._worker.check(batch.flush):
                batch.flush = None
        except ucx_native.UcxError as exc:
            self._release_batch(batch)
            raise TransportError(f"ucx: writes to peer {handle.peer!r} failed: {exc}") from exc
        return not batch.puts and batch.flush is None

    def _release_batch(self, batch: _Batch) -> None:
        for req in batch.puts:
            self._worker.release(req)
        batch.puts = []
        if batch.flush is not None:
            self._worker.release(batch.flush)
            batch.flush = None

    def _drop_peer(self, state: _Peer) -> None:
        for target in state.targets.values():
            self._worker.rkey_destroy(target.rkey)
        state.targets.clear()
        try:
            req = self._worker.ep_close(state.ep)
            deadline = time.monotonic() + _CLOSE_TIMEOUT_S
            while not self._worker.check(req):
                self._worker.progress()
                if time.monotonic() > deadline:
                    logger.warning("ucx: closing the endpoint to %r timed out", state.name)
                    self._worker.release(req)
                    break
        except ucx_native.UcxError as exc:
            logger.warning("ucx: closing the endpoint to %r failed: %s", state.name, exc)

    def _close(self) -> None:
        try:
            for state in list(self._by_peer.values()):
                self._drop_peer(state)
            self._by_peer.clear()
            for region_state in self._region_state.values():
                self._worker.mem_unmap(region_state.memh)
            self._region_state.clear()
        finally:
            self._worker.destroy()
