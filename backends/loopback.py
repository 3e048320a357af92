"""Same-host one-sided transport: writes land in shared memory (host) or CUDA IPC mappings (GPU).

The receiver does nothing per write: registering a host TARGET moves the tensor's storage into
a named POSIX shared-memory segment in place (torch's `_share_filename_cpu_`), so every
existing view of it, nn.Module parameters included, keeps working (their data pointer moves
once, at registration). A CUDA TARGET publishes a CUDA IPC handle of its storage. The sender
maps the segment (or opens the IPC handle) on the first write to it and copies straight into
the receiver's memory: host copies on one background "DMA engine" thread per transport, CUDA
copies on a dedicated stream with a completion event.

Limits worth knowing:
- Peers must share a host and a /dev/shm (same boot, same IPC namespace).
- One-sided means no signal on the target; a dead target is detected by its process instead: at
  `connect` the sender opens a pidfd of the peer's process (`os.pidfd_open`, Linux 5.3+; else
  it falls back to `os.kill(pid, 0)`, which a recycled pid or a zombie can fool), and every
  `post_writes` and every `poll` of an unfinished batch checks it (one non-blocking `poll(2)`):
  once the peer process has exited, they raise `PeerLostError` naming the peer, even though the
  copy into the still-mapped segment itself succeeds.
- Registering host memory reallocates its storage (once); raw pointers taken before that (for
  example CUDA graphs over CPU tensors, which do not exist in practice) go stale.
- The GPU path cannot be exercised on CPU-only hosts; it is kept small on purpose.

Options (`TransportConfig.options`), all for CUDA IPC writes:
- `copy_kernel` (`auto`, default, or `off`): run batches of device copies as table-kernel
  launches (`kernels/table_copy.py`) where triton imports, or always as one
  `cudaMemcpyAsync` per copy.
- `copy_chunk_bytes`, `copy_block_words`, `copy_num_warps` (powers of two): the kernels'
  tuning (`table_copy.Tuning`; the defaults were measured on an H200).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import select
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from weight_transfer.backends import _cudart
from weight_transfer.backends._memory import (
    ShmMapping,
    host_identity,
    host_view,
    memmove,
    shm_file_of,
)
from weight_transfer.backends.base import (
    ConfigurationError,
    MemoryKind,
    PeerLostError,
    PreparedWrites,
    Region,
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportCapabilities,
    TransportConfig,
    TransportError,
    WriteHandle,
    WriteOp,
)
from weight_transfer.kernels import table_copy as _table_copy

__all__ = ["LoopbackTransport"]

log = logging.getLogger(__name__)

_PAYLOAD_VERSION = 1
_JOIN_TIMEOUT_S = 10.0

# CUDA targets registered by transports of this process, by IPC handle: a process cannot open
# its own IPC handle (cudaIpcOpenMemHandle refuses), so same-process writes use the tensor.
_LOCAL_CUDA_TARGETS: dict[tuple[bytes, int], torch.Tensor] = {}
_LOCAL_CUDA_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """A decoded TARGET descriptor payload."""

    host: str
    pid: int
    owner: int
    """Random id of the transport that registered the region."""
    nbytes: int
    offset: int
    """Byte offset of the region inside the shm file (host) or the IPC storage (cuda)."""
    shm: str | None
    ipc: tuple[Any, ...] | None


def _decode_target(desc: RegionDescriptor) -> _Target:
    """Schema-check a loopback descriptor payload. Raises ValueError on anything unexpected."""
    try:
        obj = msgpack.unpackb(desc.payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"loopback descriptor payload is not valid msgpack: {exc}") from exc
    if not isinstance(obj, dict) or obj.get("v") != _PAYLOAD_VERSION:
        raise ValueError("loopback descriptor payload has an unknown format")
    host, pid, nbytes, offset = obj.get("host"), obj.get("pid"), obj.get("nbytes"), obj.get("off")
    owner = obj.get("id")
    shm, ipc = obj.get("shm"), obj.get("ipc")
    ints = (pid, owner, nbytes, offset)
    if not isinstance(host, str) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints
    ):
        raise ValueError("loopback descriptor payload has a field of the wrong type")
    pid, owner, nbytes, offset = (int(x) for x in ints)  # type: ignore[arg-type]
    if nbytes != desc.nbytes:
        raise ValueError(
            f"loopback descriptor says {desc.nbytes} bytes but its payload says {nbytes}"
        )
    if desc.kind is MemoryKind.HOST:
        if not isinstance(shm, str) or not shm or "/" in shm:
            raise ValueError("loopback host descriptor lacks a valid shared-memory name")
        return _Target(host, pid, owner, nbytes, offset, shm, None)
    if not (isinstance(ipc, list) and len(ipc) == 8 and isinstance(ipc[1], bytes)):
        raise ValueError("loopback cuda descriptor lacks a valid CUDA IPC handle")
    return _Target(host, pid, owner, nbytes, offset, None, tuple(ipc))


# A process may map a given IPC handle on a given device only once: share mappings between
# transports of one process, counted.
_IPC_OPEN: dict[tuple[bytes, int], list[int]] = {}  # (handle, device) -> [pointer, count]
_IPC_LOCK = threading.Lock()


def _ipc_acquire(key: tuple[bytes, int]) -> int:
    with _IPC_LOCK:
        entry = _IPC_OPEN.get(key)
        if entry is None:
            with torch.cuda.device(key[1]):
                entry = _IPC_OPEN[key] = [_cudart.ipc_open(key[0]), 0]
        entry[1] += 1
        return entry[0]


def _ipc_release(key: tuple[bytes, int]) -> None:
    with _IPC_LOCK:
        entry = _IPC_OPEN.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _IPC_OPEN[key]
            with torch.cuda.device(key[1]):
                try:
                    _cudart.ipc_close(entry[0])
                except TransportError as exc:
                    log.warning("loopback: closing a CUDA IPC mapping failed: %s", exc)


class _BatchState:
    """Completion state of one posted batch (handle.state)."""

    __slots__ = ("host_done", "error", "events", "keepalive")

    def __init__(self) -> None:
        self.host_done = threading.Event()
        self.error: BaseException | None = None
        self.events: list[Any] = []  # torch.cuda.Event
        self.keepalive: list[Any] = []  # tensors that must live until the events fire


_STOP = object()

_TABLE_MIN_COPIES = 2
"""A prepared CUDA IPC batch of at least this many copies (after coalescing) runs as
table-kernel launches instead of one cudaMemcpyAsync per copy."""
_INLINE_HOST_BYTES = 64 << 10
"""Host-to-host batches up to this size are copied in the posting thread (when no batch is
queued ahead of them), sparing the copy thread's round trip."""
_TABLE_MIN_COPIES_UNPREPARED = 32
"""The same for a batch posted once: its table must be uploaded first, a host-to-device copy
that queues behind the copy engine's other work (CPU-offloaded staging copies), so only large
batches are worth it."""


@dataclasses.dataclass(slots=True)
class _RawPlan:
    """What posting a prepared all-IPC batch needs, per writing device (PreparedWrites.state)."""

    generation: int
    """The peer's connection generation the IPC pointers belong to."""
    per_device: list[tuple[int, _table_copy.DeviceTable | None, tuple[_table_copy.Copy, ...]]]
    """(device, table or None, copies issued as plain cudaMemcpyAsync)."""


class _PeerProcess:
    """Liveness of a peer's process: a pidfd polled without blocking, else `os.kill(pid, 0)`."""

    __slots__ = ("dead", "pid", "pidfd", "poller")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.dead = False
        self.pidfd: int | None = None
        self.poller: select.poll | None = None
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:
            self.dead = not self._kill_check()
            return
        try:
            self.pidfd = pidfd_open(pid)
        except ProcessLookupError:
            self.dead = True
            return
        except OSError:  # no pidfd support in this kernel or sandbox: fall back
            self.dead = not self._kill_check()
            return
        self.poller = select.poll()
        self.poller.register(self.pidfd, select.POLLIN)

    def _kill_check(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # exists, owned by someone else
        return True

    def alive(self) -> bool:
        """False once the process has exited (a pidfd becomes readable then)."""
        if not self.dead:
            if self.poller is not None:
                self.dead = bool(self.poller.poll(0))
            else:
                self.dead = not self._kill_check()
        return not self.dead

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
            self.poller = None


def _copy_tuning(config: TransportConfig) -> _table_copy.Tuning:
    """The copy kernels' tuning from the `copy_*` options (defaults where not given)."""
    given: dict[str, int] = {}
    for key in ("copy_chunk_bytes", "copy_block_words", "copy_num_warps"):
        value = config.option(key)
        if value is None:
            continue
        try:
            given[key.removeprefix("copy_")] = int(value)
        except ValueError:
            raise ConfigurationError(
                f"loopback: option {key}={value!r}: expected an integer"
            ) from None
    try:
        return _table_copy.Tuning(**given)
    except ValueError as exc:
        raise ConfigurationError(f"loopback: option copy_{exc}") from exc


class LoopbackTransport(Transport):
    """Same-host, truly one-sided transport over POSIX shared memory and CUDA IPC.

    `post_writes` never blocks: host copies go to a background copy thread, CUDA copies to a
    dedicated stream. Writes to one peer are copied in posting order, but the contract promises
    no ordering. Driven from one thread, like every Transport.
    """

    name = "loopback"
    option_names = frozenset(
        {"copy_kernel", "copy_chunk_bytes", "copy_block_words", "copy_num_warps"}
    )

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self._host = host_identity()
        self._pid = os.getpid()
        self._id = secrets.randbits(63)  # tells transports of one process apart
        self._peer_ids: dict[str, tuple[int, int]] = {}  # peer -> (pid, transport id)
        self._peer_procs: dict[str, _PeerProcess] = {}  # peers in other processes
        self._mappings: dict[str, dict[str, ShmMapping]] = {}  # peer -> shm name -> mapping
        self._cuda_targets: dict[
            tuple[str, bytes, int], torch.Tensor
        ] = {}  # (peer, handle, offset)
        self._ipc_ptrs: dict[tuple[bytes, int], int] = {}  # (handle, device) -> base pointer
        self._decoded: dict[str, dict[bytes, _Target]] = {}  # peer -> payload -> checked target
        self._ipc_peers: dict[str, set[tuple[bytes, int]]] = {}
        self._local_cuda_handles: dict[int, tuple[bytes, int]] = {}  # region id -> (handle, offset)
        self._streams: dict[int, Any] = {}  # device index -> torch.cuda.Stream
        self._generation: dict[str, int] = {}  # peer -> bumped at every connect
        self._next_generation = 0
        mode = config.option("copy_kernel", "auto")
        if mode not in ("auto", "off"):
            raise ConfigurationError(
                f"loopback: option copy_kernel={mode!r}: expected 'auto' or 'off'"
            )
        self._copy_kernel = mode == "auto" and torch.cuda.is_available() and _table_copy.available()
        self._tuning = _copy_tuning(config)
        kinds = {MemoryKind.HOST}
        if torch.cuda.is_available():
            kinds.add(MemoryKind.CUDA)
        self._caps = TransportCapabilities(
            memory_kinds=frozenset(kinds), one_sided=True, cross_host=False
        )
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._host_lock = threading.Lock()
        self._host_queued = 0  # host-copy batches handed to the copy thread, not yet done
        self._dma = threading.Thread(
            target=self._dma_loop, name=f"loopback-dma-{self._pid}", daemon=True
        )
        self._dma.start()

    # -- capabilities / endpoint ----------------------------------------------------------

    def _capabilities(self) -> TransportCapabilities:
        return self._caps

    def _endpoint(self) -> bytes:
        return msgpack.packb(
            {"v": _PAYLOAD_VERSION, "host": self._host, "pid": self._pid, "id": self._id},
            use_bin_type=True,
        )

    # -- registration ---------------------------------------------------------------------

    def _register(self, region_id: int, flat: torch.Tensor, role: RegionRole) -> Region:
        kind = MemoryKind.of(flat)
        descriptor = None
        if role is RegionRole.TARGET:
            if kind is MemoryKind.HOST:
                payload = self._share_host(flat)
            else:
                payload = self._share_cuda(region_id, flat)
            descriptor = RegionDescriptor(
                backend=self.name, kind=kind, nbytes=flat.numel(), payload=payload
            )
        return Region.of(region_id, flat, role, descriptor)

    def _share_host(self, flat: torch.Tensor) -> bytes:
        storage = flat.untyped_storage()
        try:
            # Moves the storage into /dev/shm in place (or returns the existing segment).
            _, handle, _ = storage._share_filename_cpu_()
        except RuntimeError as exc:
            raise TransportError(
                f"loopback: cannot move this tensor's storage into shared memory ({exc}); "
                "register a tensor allocated by torch"
            ) from exc
        found = shm_file_of(flat.data_ptr())
        name = handle.decode().lstrip("/")
        if found is None or found[0] != name:
            raise TransportError(
                f"loopback: storage was shared as {name!r} but is not mapped from /dev/shm here "
                "(shared with the file_descriptor strategy?); register a fresh tensor"
            )
        return msgpack.packb(
            {
                "v": _PAYLOAD_VERSION,
                "host": self._host,
                "pid": self._pid,
                "id": self._id,
                "nbytes": flat.numel(),
                "off": found[1],
                "shm": name,
            },
            use_bin_type=True,
        )

    def _share_cuda(self, region_id: int, flat: torch.Tensor) -> bytes:
        storage = flat.untyped_storage()
        try:
            fields = storage._share_cuda_()
        except RuntimeError as exc:
            raise TransportError(
                f"loopback: cannot export a CUDA IPC handle for this tensor ({exc}); memory from "
                "expandable segments cannot be shared"
            ) from exc
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
        # Keyed by handle and offset: tensors of one allocator block share the handle.
        local_key = (bytes(handle), int(offset))
        with _LOCAL_CUDA_LOCK:
            _LOCAL_CUDA_TARGETS[local_key] = flat
        self._local_cuda_handles[region_id] = local_key
        ipc = [
            int(device),
            bytes(handle),
            int(size),
            int(offset),
            bytes(ref_handle),
            int(ref_offset),
            bytes(event_handle),
            bool(event_sync),
        ]
        return msgpack.packb(
            {
                "v": _PAYLOAD_VERSION,
                "host": self._host,
                "pid": self._pid,
                "id": self._id,
                "nbytes": flat.numel(),
                "off": flat.data_ptr() - storage.data_ptr(),
                "ipc": ipc,
            },
            use_bin_type=True,
        )

    def _deregister(self, region: Region) -> None:
        # Host storage stays in shared memory (moving it back would move the caller's views
        # again); only the process-local CUDA lookup is dropped.
        handle = self._local_cuda_handles.pop(region.region_id, None)
        if handle is not None:
            with _LOCAL_CUDA_LOCK:
                _LOCAL_CUDA_TARGETS.pop(handle, None)

    # -- peers ----------------------------------------------------------------------------

    def _connect(self, peer: str, endpoint: bytes) -> None:
        try:
            obj = msgpack.unpackb(endpoint, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"loopback: endpoint of peer {peer!r} is not valid msgpack") from exc
        if not isinstance(obj, dict) or obj.get("v") != _PAYLOAD_VERSION:
            raise ValueError(f"loopback: endpoint of peer {peer!r} is not a loopback endpoint")
        host, pid, owner = obj.get("host"), obj.get("pid"), obj.get("id")
        if not isinstance(host, str) or not isinstance(pid, int) or not isinstance(owner, int):
            raise ValueError(f"loopback: endpoint of peer {peer!r} has fields of the wrong type")
        if host != self._host:
            raise ConfigurationError(
                f"loopback: peer {peer!r} is on host {host!r}, this process is on {self._host!r}; "
                "the loopback backend only connects processes of one host (use tcp, ucx or nixl)"
            )
        self._peer_ids[peer] = (pid, owner)
        self._next_generation += 1
        self._generation[peer] = self._next_generation
        self._mappings[peer] = {}
        if pid != self._pid:
            self._peer_procs[peer] = _PeerProcess(pid)

    def _check_alive(self, peer: str) -> None:
        proc = self._peer_procs.get(peer)
        if proc is not None and not proc.alive():
            raise PeerLostError(
                f"loopback: peer {peer!r} is gone: its process {proc.pid} has exited"
            )

    def _disconnect(self, peer: str) -> None:
        self._peer_ids.pop(peer, None)
        self._generation.pop(peer, None)
        proc = self._peer_procs.pop(peer, None)
        if proc is not None:
            proc.close()
        self._decoded.pop(peer, None)
        mappings = self._mappings.pop(peer, {})
        for key in [k for k in self._cuda_targets if k[0] == peer]:
            del self._cuda_targets[key]
        self._release_ipc(self._ipc_peers.pop(peer, set()))
        if mappings:
            # Behind every copy already queued, so nothing in flight loses its mapping.
            self._jobs.put(list(mappings.values()))

    # -- writes ---------------------------------------------------------------------------

    def _post_writes(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        self._check_alive(peer)
        state = _BatchState()
        host_copies: list[tuple[int, int, int]] = []
        cuda_ops: list[tuple[torch.Tensor, torch.Tensor]] = []
        raw_ops: dict[int, list[tuple[int, int, int, torch.Tensor]]] = {}
        # Descriptors repeat every update: decode and check each one once per peer.
        decoded = self._decoded.setdefault(peer, {})
        for i, op in enumerate(ops):
            target = decoded.get(op.target.payload)
            if target is None:
                target = decoded[op.target.payload] = self._check_target(peer, i, op.target)
            if op.source.kind is MemoryKind.HOST and op.target.kind is MemoryKind.HOST:
                dst = self._map(peer, target) + target.offset + op.target_offset
                host_copies.append((dst, op.source.address + op.source_offset, op.nbytes))
            elif target.ipc is not None and not self._is_local_ipc(target):
                device = self._writer_device(op)
                dst = self._open_ipc_ptr(peer, target.ipc, device)
                dst += int(target.ipc[3]) + target.offset + op.target_offset
                raw_ops.setdefault(device, []).append(
                    (dst, op.source.address + op.source_offset, op.nbytes, op.source.tensor)
                )
            else:
                src = op.source.tensor[op.source_offset : op.source_offset + op.nbytes]
                cuda_ops.append((self._target_view(peer, target, op), src))
        if cuda_ops:
            self._post_cuda(cuda_ops, state)
        for device, copies in raw_ops.items():
            self._post_raw(device, copies, state)
        if host_copies and self._inline_ok(host_copies):
            # A few bytes (version words, small tensors) with nothing queued ahead of them:
            # copied here, not handed to the copy thread and back (two thread switches).
            self._run_copies(peer, host_copies, state)
        elif host_copies:
            with self._host_lock:
                self._host_queued += 1
            self._jobs.put((peer, host_copies, state))
        else:
            state.host_done.set()
        handle.state = state

    def _inline_ok(self, copies: list[tuple[int, int, int]]) -> bool:
        with self._host_lock:
            idle = self._host_queued == 0
        return idle and sum(c[2] for c in copies) <= _INLINE_HOST_BYTES

    def _run_copies(
        self, peer: str, copies: list[tuple[int, int, int]], state: _BatchState
    ) -> None:
        try:
            for dst, src, nbytes in copies:
                memmove(dst, src, nbytes)
        except Exception as exc:  # a copy error must reach the poller, never vanish
            log.exception("loopback: copy to peer %r failed", peer)
            state.error = TransportError(f"loopback: write to peer {peer!r} failed: {exc}")
        finally:
            state.host_done.set()

    def _check_target(self, peer: str, index: int, desc: RegionDescriptor) -> _Target:
        try:
            target = _decode_target(desc)
        except ValueError as exc:
            raise ValueError(f"write {index} to {peer!r}: {exc}") from exc
        if target.host != self._host:
            raise ValueError(
                f"write {index} to {peer!r}: target descriptor is from host {target.host!r}, "
                f"not this host {self._host!r}"
            )
        pid, owner = self._peer_ids[peer]
        if (target.pid, target.owner) != (pid, owner):
            raise ValueError(
                f"write {index} to {peer!r}: target descriptor belongs to another transport "
                f"(process {target.pid}, id {target.owner:#x}), not to peer {peer!r} "
                f"(process {pid}, id {owner:#x})"
            )
        if desc.kind not in self.capabilities.memory_kinds:
            raise ValueError(
                f"write {index} to {peer!r}: target is {desc.kind.value} memory, which this "
                "process cannot reach"
            )
        return target

    def _map(self, peer: str, target: _Target) -> int:
        """Address of the sender's mapping of the target's shm segment (opened on first use)."""
        assert target.shm is not None
        mappings = self._mappings[peer]
        mapping = mappings.get(target.shm)
        if mapping is None:
            try:
                mapping = ShmMapping(target.shm)
            except FileNotFoundError as exc:
                raise PeerLostError(
                    f"loopback: shared memory {target.shm!r} of peer {peer!r} is gone "
                    "(the peer exited or its tensor was freed)"
                ) from exc
            except (OSError, ValueError) as exc:
                raise TransportError(
                    f"loopback: cannot map shared memory {target.shm!r} of peer {peer!r}: {exc}"
                ) from exc
            mappings[target.shm] = mapping
        if target.offset + target.nbytes > mapping.nbytes:
            raise ValueError(
                f"loopback: descriptor of peer {peer!r} claims bytes [{target.offset}, "
                f"{target.offset + target.nbytes}) of {target.shm!r}, which has only "
                f"{mapping.nbytes} bytes"
            )
        return mapping.address

    def _dma_loop(self) -> None:
        """The copy engine: memmove batches in posting order; errors go into the batch state."""
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            if isinstance(job, list):  # mappings released by disconnect/close
                for mapping in job:
                    mapping.close()
                continue
            peer, copies, state = job
            try:
                self._run_copies(peer, copies, state)
            finally:
                with self._host_lock:
                    self._host_queued -= 1

    def _completion_event(self, handle: WriteHandle) -> threading.Event | None:
        state: _BatchState = handle.state
        return None if state.events else state.host_done

    def _quiesce(self, handle: WriteHandle) -> bool:
        # A failed batch (its copy failed, or its peer's process exited) may still be in the
        # copy thread's queue or mid-copy, and its device copies may still run: it is quiet
        # once the copy thread is done with it and every copy event has fired.
        state: _BatchState | None = handle.state
        if state is None:
            return True
        if not state.host_done.is_set():
            return False
        if state.events and not all(event.query() for event in state.events):
            return False
        state.keepalive.clear()
        return True

    def _poll(self, handle: WriteHandle) -> bool:
        state: _BatchState = handle.state
        if state.error is not None:
            raise state.error
        self._check_alive(handle.peer)
        if not state.host_done.is_set():
            return False
        if state.events:
            if not all(event.query() for event in state.events):
                return False
            state.keepalive.clear()
        return True

    # -- CUDA path ------------------------------------------------------------------------

    def _target_view(self, peer: str, target: _Target, op: WriteOp) -> torch.Tensor:
        """A uint8 tensor over the target bytes of `op` (host mapping or opened IPC storage)."""
        begin = target.offset + op.target_offset
        if target.shm is not None:
            base = self._map(peer, target)
            return torch.frombuffer(host_view(base + begin, op.nbytes), dtype=torch.uint8)
        assert target.ipc is not None
        whole = self._open_ipc(peer, target.ipc)
        return whole[begin : begin + op.nbytes]

    def _open_ipc(self, peer: str, ipc: tuple[Any, ...]) -> torch.Tensor:
        # Tensors of one caching-allocator block share its IPC handle and differ in their
        # storage offset (ipc[3]): the offset is part of what was opened.
        key = (peer, bytes(ipc[1]), int(ipc[3]))
        view = self._cuda_targets.get(key)
        if view is not None:
            return view
        with _LOCAL_CUDA_LOCK:
            local = _LOCAL_CUDA_TARGETS.get((bytes(ipc[1]), int(ipc[3])))
        if local is not None:
            storage = local.untyped_storage()
        else:
            try:
                storage = torch.UntypedStorage._new_shared_cuda(*ipc)
            except RuntimeError as exc:
                raise TransportError(
                    f"loopback: cannot open the CUDA IPC handle of peer {peer!r}: {exc}"
                ) from exc
        device = torch.device("cuda", int(ipc[0]))
        view = torch.empty((0,), dtype=torch.uint8, device=device)
        view.set_(storage, 0, (storage.nbytes(),), (1,))
        self._cuda_targets[key] = view
        return view

    def _is_local_ipc(self, target: _Target) -> bool:
        assert target.ipc is not None
        with _LOCAL_CUDA_LOCK:
            return (bytes(target.ipc[1]), int(target.ipc[3])) in _LOCAL_CUDA_TARGETS

    def _writer_device(self, op: WriteOp) -> int:
        """The GPU whose copy engine writes: the source's, else the configured or current one."""
        if op.source.kind is MemoryKind.CUDA and op.source.device_index is not None:
            return op.source.device_index
        if self.config.device_index is not None:
            return self.config.device_index
        return torch.cuda.current_device()

    def _open_ipc_ptr(self, peer: str, ipc: tuple[Any, ...], device: int) -> int:
        """Base pointer of a peer allocation, mapped into `device`'s context (cached)."""
        key = (bytes(ipc[1]), device)
        ptr = self._ipc_ptrs.get(key)
        if ptr is None:
            try:
                ptr = _ipc_acquire(key)
            except TransportError as exc:
                raise TransportError(
                    f"loopback: cannot open the CUDA IPC handle of peer {peer!r} on device "
                    f"{device}: {exc}"
                ) from exc
            self._ipc_ptrs[key] = ptr
            self._ipc_peers.setdefault(peer, set()).add(key)
        return ptr

    def _post_raw(
        self, device: int, copies: list[tuple[int, int, int, torch.Tensor]], state: _BatchState
    ) -> None:
        """The copies on the writer's stream into IPC mappings opened on that device: coalesced
        and run as table-kernel launches when there are several, else cudaMemcpyAsync each."""
        table, plain = self._raw_plan(
            [(_table_copy.Copy(d, s, n), t.is_cuda) for d, s, n, t in copies],
            _TABLE_MIN_COPIES_UNPREPARED,
        )
        self._launch_raw(device, table, plain, state)
        state.keepalive.extend(c[3] for c in copies)

    def _raw_plan(
        self, copies: list[tuple[_table_copy.Copy, bool]], min_copies: int
    ) -> tuple[_table_copy.ChunkTable | None, list[_table_copy.Copy]]:
        """Split copies into a kernel table and plain cudaMemcpyAsync calls. Only device-to-
        device copies with aligned addresses and lengths are coalesced and go to the kernels;
        copies from host memory stay on the copy engine (DMA beats SM loads over PCIe) and are
        never merged, since a cudaMemcpy may not span two allocations that merely adjoin."""
        kernel: list[_table_copy.Copy] = []
        plain: list[_table_copy.Copy] = []
        align = _table_copy.ALIGN
        for c, from_device in copies:
            if (
                self._copy_kernel
                and from_device
                and not (c.dst % align or c.src % align or c.nbytes % align)
            ):
                kernel.append(c)
            else:
                plain.append(c)
        merged = _table_copy.coalesce(kernel)
        if len(merged) < min_copies:
            return None, plain + kernel
        chunked = _table_copy.chunk_table(merged, self._tuning.chunk_bytes)
        assert not chunked.plain  # every merged copy is aligned
        return chunked, plain

    def _launch_raw(
        self,
        device: int,
        table: _table_copy.ChunkTable | _table_copy.DeviceTable | None,
        plain: Sequence[_table_copy.Copy],
        state: _BatchState,
    ) -> None:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        producer = torch.cuda.current_stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            # The sources may still be being produced on the caller's current stream.
            stream.wait_stream(producer)
            if isinstance(table, _table_copy.ChunkTable):
                # Built for this batch only: upload through pinned memory on this stream.
                table = _table_copy.DeviceTable(
                    table.chunks.pin_memory().to(stream.device, non_blocking=True),
                    table.tails.pin_memory().to(stream.device, non_blocking=True),
                    table.plain,
                    table.nbytes,
                    0,
                )
            if table is not None:
                t = self._tuning
                _table_copy.launch(table, t.chunk_bytes, t.block_words, t.num_warps)
                state.keepalive.append(table)
            handle = stream.cuda_stream
            for c in plain:
                _cudart.memcpy_async(c.dst, c.src, c.nbytes, handle)
            event = torch.cuda.Event()
            event.record(stream)
        state.events.append(event)

    def _prepare_writes(self, prepared: PreparedWrites) -> None:
        """A batch whose every write goes from CUDA memory into a peer's IPC mapping keeps its
        coalesced copy table on the device, so posting it is a launch or two and nothing per
        write. Other batches post as usual."""
        prepared.state = None
        peer = prepared.peer
        decoded = self._decoded.setdefault(peer, {})
        per_device: dict[int, list[tuple[_table_copy.Copy, bool]]] = {}
        for i, op in enumerate(prepared.ops):
            target = decoded.get(op.target.payload)
            if target is None:
                target = decoded[op.target.payload] = self._check_target(peer, i, op.target)
            if target.ipc is None or self._is_local_ipc(target):
                return
            device = self._writer_device(op)
            dst = self._open_ipc_ptr(peer, target.ipc, device)
            dst += int(target.ipc[3]) + target.offset + op.target_offset
            per_device.setdefault(device, []).append(
                (
                    _table_copy.Copy(dst, op.source.address + op.source_offset, op.nbytes),
                    op.source.kind is MemoryKind.CUDA,
                )
            )
        plan = _RawPlan(self._generation.get(peer, 0), [])
        for device, copies in per_device.items():
            chunked, plain = self._raw_plan(copies, _TABLE_MIN_COPIES)
            table = None
            if chunked is not None:
                table = _table_copy.to_device(
                    chunked, torch.device("cuda", device), int(chunked.chunks.shape[0])
                )
            plan.per_device.append((device, table, tuple(plain)))
        prepared.state = plan

    def _mapped_view(
        self, peer: str, target: RegionDescriptor, offset: int, nbytes: int, device: torch.device
    ) -> torch.Tensor | None:
        """The target bytes as a tensor on `device` when the peer's memory is on that very GPU
        (the one-GPU colocated layout): kernels then write into it at the memory's rate. On
        another GPU None: torch's IPC mapping would be the slow exporter-context one."""
        if device.type != "cuda" or target.kind is not MemoryKind.CUDA:
            return None
        decoded = self._decoded.setdefault(peer, {})
        t = decoded.get(target.payload)
        if t is None:
            t = decoded[target.payload] = self._check_target(peer, 0, target)
        if t.ipc is None or int(t.ipc[0]) != device.index:
            return None
        whole = self._open_ipc(peer, t.ipc)
        begin = t.offset + offset
        return whole[begin : begin + nbytes]

    def _post_prepared(self, prepared: PreparedWrites, handle: WriteHandle) -> None:
        peer = prepared.peer
        self._check_alive(peer)
        plan = prepared.state
        if not isinstance(plan, _RawPlan) or plan.generation != self._generation.get(peer, 0):
            self._prepare_writes(prepared)  # first post, or the peer reconnected since
            plan = prepared.state
        if not isinstance(plan, _RawPlan):
            self._post_writes(peer, list(prepared.ops), handle)
            return
        state = _BatchState()
        for device, table, plain in plan.per_device:
            self._launch_raw(device, table, plain, state)
        state.host_done.set()
        handle.state = state

    def _post_cuda(
        self, copies: list[tuple[torch.Tensor, torch.Tensor]], state: _BatchState
    ) -> None:
        for dst, src in copies:
            device = src.device if src.is_cuda else dst.device
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = torch.cuda.Stream(device=device)
            # The source may still be being produced on the caller's current stream.
            producer = torch.cuda.current_stream(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_stream(producer)
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            state.events.append(event)
            state.keepalive.extend((dst, src))

    def _release_ipc(self, keys: set[tuple[bytes, int]]) -> None:
        for stream in self._streams.values():
            stream.synchronize()  # nothing in flight may lose its mapping
        for key in keys:
            if self._ipc_ptrs.pop(key, None) is not None:
                _ipc_release(key)

    # -- close ----------------------------------------------------------------------------

    def _close(self) -> None:
        for proc in self._peer_procs.values():
            proc.close()
        self._peer_procs.clear()
        released: list[ShmMapping] = []
        for mappings in self._mappings.values():
            released.extend(mappings.values())
        self._mappings.clear()
        if released:
            self._jobs.put(released)
        self._jobs.put(_STOP)
        self._dma.join(timeout=_JOIN_TIMEOUT_S)
        if self._dma.is_alive():
            log.warning("loopback: copy thread did not stop within %.0f s", _JOIN_TIMEOUT_S)
        for stream in self._streams.values():
            stream.synchronize()
        for keys in list(self._ipc_peers.values()):
            self._release_ipc(keys)
        self._ipc_peers.clear()
        self._streams.clear()
        self._cuda_targets.clear()
        with _LOCAL_CUDA_LOCK:
            for handle in self._local_cuda_handles.values():
                _LOCAL_CUDA_TARGETS.pop(handle, None)
        self._local_cuda_handles.clear()
