"""NIXL backend: WRITE transfers between NIXL agents with prepared descriptor lists.

Uses NIXL's Python API (`nixl_cu13`, NIXL 1.5.1; see NIXL's docs/python_api.md) with its UCX
plugin. What travels over our control plane:

- endpoint bytes: msgpack `["nixl", agent name, agent metadata]`, the metadata from
  `get_agent_metadata()` (NIXL's own binary serialisation, loaded with `add_remote_agent`);
- a region descriptor's payload: msgpack `[agent name, address, nbytes, device id, memory
  type, partial metadata]`, the partial metadata from `get_partial_agent_metadata` for just
  that registration, so a peer can write into a region registered after the endpoints were
  exchanged. NIXL's own `get_serialized_descs` is not used: it is pickle.

Writes: a batch is grouped by (source memory type, target memory type) and cut into segments
of at most `segment_bytes` (by default 64 MiB for host sources, uncut for GPU sources); each
segment is one NIXL transfer built from two prepared
descriptor lists (`prep_xfer_dlist`, local and remote) and `make_prepped_xfer("WRITE", ...)`.
Lists and transfer handles are cached by (peer, exact segment layout): a static schedule posts
the same batches every update, so after the first update a segment costs one `transfer()` call
and no preparation. `post_writes` and each `poll` start segments (while fewer than `window`
run) until the call has run 2 ms: on asynchronous lanes (cuda_ipc, RDMA) every segment starts
in `post_writes`; NIXL's UCX moves host memory on one host with cma inside `transfer()` itself,
so there one call starts (copies) one segment, and a 1 GiB batch is not copied inside
`post_writes`. Each `poll` checks the running ones (`check_xfer_state`, which also progresses
UCX: the class is `progress_driven`, `Transport.wait` polls without sleeping). A handle goes
back to the cache once it reports DONE.

Options (`TransportConfig.options`):
- `ucx_error_handling_mode` (default `none`), `num_workers`: passed to NIXL's UCX plugin.
  Mode `none` keeps UCX's one-sided lanes (cma on one host, cuda_ipc for GPUs, RDMA); with
  `peer` UCX emulates puts with messages that the target must progress, and this backend runs
  no progress on targets. The consequence of `none`: a dead peer is not reported by UCX; its
  transfers never complete and `Transport.wait`'s timeout names the peer.
- `ucx_devices` (for example `mlx5_0:1`, or `rxe0:1`): the devices UCX may use, set as UCX's
  `NET_DEVICES` (NIXL 1.5.1's UCX plugin ignores its own `ucx_devices` parameter). Giving both
  it and `UCX_NET_DEVICES` is refused.
- The devices default to `lo` when `config.listen_host` is a loopback address (the default)
  and neither option nor the process environment's `UCX_NET_DEVICES` names any, so a default
  transport opens no interface but `lo` (and UCX's shared-memory lanes).
- `lanes` (default 1): how many copy streams move one host segment at once. See Lanes below,
  including why more than one is not the default.
- `segment_bytes` (default: 64 MiB for host sources, none for GPU sources; given, it applies to
  both) and `window` (default: no limit): see Writes above. Measured on 2 vCPUs with host
  memory, segment size hardly changes throughput (the copy is cma either way); on GPUs the old
  16 MiB segments started one per poll made 256 MiB writes 8x slower than 64 MiB ones.
- keys starting with `UCX_` (for example `UCX_TLS`): UCX configuration of this transport's own
  UCX context, passed as NIXL's UCX plugin parameter `engine_config` ("KEY=VALUE,...", the
  `UCX_` prefix dropped), which NIXL 1.5.1 applies with `ucp_config_modify` after its own
  defaults. Nothing else in the process sees them (vLLM's own NIXL or UCX users keep their
  settings). Three consequences of how NIXL handles that parameter: a variable of the same name
  already set in the process environment wins over the option (NIXL skips a key the
  environment sets); UCX does not check the names, so a misspelt key is ignored silently; and
  NIXL cuts the parameter at commas, so it cannot carry a list value (`UCX_TLS=rc,cuda_ipc`).
  A value with a comma is therefore set in the process environment only while the constructor
  creates the agent and its UCX context (when UCX reads its configuration), under a lock, and
  the variable's previous value (or its absence) is restored right after: another thread that
  reads the environment or creates a UCX context at that very moment sees it, nothing later
  does. UCX's process-global options (`UCX_LOG_LEVEL` and the like) belong to no UCX context:
  UCX reads them once, when NIXL first loads its UCX plugin in the process, so set those in the
  process's environment instead. The library never reads the environment for its own
  configuration.

The agent runs without NIXL's progress thread (`enable_prog_thread=False`): the thread that
polls drives progress, which suits the two-core machines this runs on.
Not thread-safe, like every `Transport`.

Lanes (`lanes` > 1). One cma stream (`process_vm_writev`) copies ~5 GB/s on the 2-vCPU
machines this is measured on, two concurrent ones ~1.5x that. NIXL 1.5.1 offers concurrency
only inside its UCX plugin: with the plugin parameter `num_threads` = N > 0 the engine is a
thread-pool engine (N threads, each with its own UCX worker) that cuts a transfer's descriptor
list into chunks of `split_batch_size` descriptors and copies the chunks on its threads;
`transfer()` then returns at once and the threads finish the transfer alone. Found by
experiment (strace of which thread calls process_vm_writev), because the alternatives do not
work: the pybind `transfer()`/`check_xfer_state()` keep the GIL (two Python threads posting on
separate transfers, with `num_workers` 2 and `NIXL_THREAD_SYNC_STRICT`, copy no faster than
one; with the default sync mode NONE they crash the process), and a transfer with fewer
descriptors than `split_batch_size` is still copied inside `transfer()` by the caller.
So with lanes N this backend creates the plugin with `num_threads` N and `split_batch_size` 1
and gives each host segment up to N descriptors of equal bytes (a piece shorter than
`_MIN_LANE_BYTES` per lane is not cut), listed in reverse address order: NIXL merges
descriptors that are contiguous on both sides and adjacent in the list, which would turn the
lanes back into one chunk. Consequences: the engine's N threads exist for the agent's life
(they sleep when idle: no CPU measured); they also serve GPU transfers, which is why the
default is 1 when the transport has a CUDA device (unmeasured there); and since the threads
complete transfers alone, a laned transport is not `progress_driven` (its `wait` polls with
a short sleep instead of spinning, leaving both cores to the copies). Closing the agent joins
NIXL's threads (NIXL's destructor; a copy in flight is at most one lane of one segment).

Why `lanes` defaults to 1: with the thread-pool engine, a process whose peer was SIGKILLed in
the middle of a transfer can abort inside NIXL's bundled UCX while its agent is torn down
(`arbiter.c:36 Assertion 'ucs_arbiter_group_is_empty(group)' failed`, SIGABRT), after the
failure itself was reported correctly. `test_engine_killed_mid_update[nixl]` hit it in 2 of 5
runs on a loaded 2-core machine with lanes 2, and in 0 of 6 with lanes 1. Two lanes copied
host memory 1.5-1.9x faster on that machine (`benchmarks/results/transports_cpu-2core_202611.md`);
use them where no peer dies mid-transfer, or where a crash on teardown is acceptable.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
import os
import sys
import time
import uuid
from typing import Any

import msgpack
import torch

from weight_transfer.backends._environment import process_environment
from weight_transfer.backends._memory import cut_at
from weight_transfer.backends.base import (
    EXTRAS,
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
    TransportUnavailableError,
    WriteHandle,
    WriteOp,
)
from weight_transfer.backends.ucx_native import _builds as ucx_builds

__all__ = ["NixlTransport"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = EXTRAS["nixl"]
_ENDPOINT_TAG = "nixl"
_PLUGIN_OPTIONS = ("ucx_error_handling_mode", "num_workers")
_OWN_OPTIONS = ("segment_bytes", "window", "lanes")
_DEFAULT_SEGMENT_BYTES = {"DRAM": 64 << 20, "VRAM": 0}
"""Segment size by source memory type when the option is not given; 0: one transfer per group."""
_DEFAULT_WINDOW = 0
"""0: no limit on segments in flight."""
_DEFAULT_LANES = {False: 1, True: 1}
"""Copy streams per host segment by whether the transport has a CUDA device (see Lanes): one,
until NIXL's thread-pool engine survives a lost peer (see Lanes)."""
_MIN_LANE_BYTES = 1 << 20
"""A host segment is cut into at most one lane per this many bytes."""
_START_BUDGET_S = 0.002
"""A post or poll starts further segments only while it has run for less than this."""
_MAX_CACHED_BATCHES = 4096
_MEM_TYPE = {MemoryKind.HOST: "DRAM", MemoryKind.CUDA: "VRAM"}


# Re-exported: NIXL's bundled UCX is the build that ships the efa module (see there).
UCX_MODULES_DEFAULT = ucx_builds.UCX_MODULES_DEFAULT
keep_efa_module_out = ucx_builds.keep_efa_module_out


def _import_nixl() -> Any:
    keep_efa_module_out()
    try:
        import nixl_cu13
    except ImportError as exc:
        raise TransportUnavailableError(
            f"transport 'nixl' needs the NIXL wheel ({exc}); install it with: {_INSTALL_HINT}"
        ) from exc
    _quiet_nixl_logging()
    return nixl_cu13


def _quiet_nixl_logging() -> None:
    """Point NIXL's own log handler at stderr, at WARNING.

    NIXL configures a handler of its `nixl` logger that writes every agent's INFO lines to
    stdout, which breaks `weight-transfer doctor --json | ...` and clutters result tables. Its
    warnings and errors still show, on stderr.
    """
    nixl_log = logging.getLogger("nixl")
    if nixl_log.level < logging.WARNING:
        nixl_log.setLevel(logging.WARNING)
    for handler in nixl_log.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _positive_int_option(config: TransportConfig, key: str, default: int) -> int:
    raw = config.option(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigurationError(f"nixl: option {key!r} must be a positive integer, got {raw!r}")
    return value


# Shared with the ucx backend: one lock for every temporary change of the environment.
_process_environment = process_environment


def _has_cuda(config: TransportConfig) -> bool:
    return config.device_index is not None and torch.cuda.is_available()


def _lanes_option(config: TransportConfig) -> int:
    """The `lanes` option, checked; its default depends on whether there is a CUDA device."""
    return _positive_int_option(config, "lanes", _DEFAULT_LANES[_has_cuda(config)])


def _cut(
    pieces: list[tuple[int, int, int, int, int, int]], bounds: list[int]
) -> list[list[tuple[int, int, int, int, int, int]]]:
    """`cut_at` over (src, src_dev, dst, dst_dev, nbytes, region_id) pieces."""
    return [
        [
            (pieces[i][0] + off, pieces[i][1], pieces[i][2] + off, pieces[i][3], n, pieces[i][5])
            for i, off, n in share
        ]
        for share in cut_at([piece[4] for piece in pieces], bounds)
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """A peer's registered region, decoded from a descriptor payload."""

    agent: str
    address: int
    nbytes: int
    device_id: int
    mem_type: str
    partial_md: bytes


def _encode_payload(target: _Target) -> bytes:
    data: bytes = msgpack.packb(
        [
            target.agent,
            target.address,
            target.nbytes,
            target.device_id,
            target.mem_type,
            target.partial_md,
        ],
        use_bin_type=True,
    )
    return data


def _decode_payload(payload: bytes) -> _Target:
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"nixl region payload is not valid msgpack: {exc}") from exc
    ok = (
        isinstance(obj, list)
        and len(obj) == 6
        and isinstance(obj[0], str)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in obj[1:4])
        and obj[4] in ("DRAM", "VRAM")
        and isinstance(obj[5], bytes)
    )
    if not ok:
        raise ValueError(
            "nixl region payload must be [agent, address, nbytes, device id, DRAM|VRAM, metadata]"
        )
    return _Target(*obj)


@dataclasses.dataclass(slots=True)
class _Peer:
    name: str
    agent: str
    targets: dict[bytes, _Target] = dataclasses.field(default_factory=dict)
    """Regions of this peer whose metadata is loaded, by descriptor payload."""


@dataclasses.dataclass(slots=True)
class _Prepared:
    """Prepared lists for one group of a batch layout, and its reusable transfer handles."""

    peer: str
    source_ids: frozenset[int]
    local: Any
    remote: Any
    num_descs: int
    idle: list[Any] = dataclasses.field(default_factory=list)
    busy: int = 0


@dataclasses.dataclass(slots=True)
class _Batch:
    todo: collections.deque[_Prepared]
    """Segments not started yet, in order."""
    running: list[tuple[_Prepared, Any]]
    """Started segments and their transfer handles."""
    failure: str | None = None
    """Why the batch failed. Segments not started are dropped; started ones stay in `running`
    until NIXL reports them no longer in progress (`_quiesce`): a transfer still in PROC may
    be reading its memory, and releasing its handle does not wait for it."""


class NixlTransport(Transport):
    """NIXL agent with the UCX plugin. See the module docstring for the options.

    Raises (constructor):
        TransportUnavailableError: the NIXL wheel is missing or its UCX plugin cannot start.
        ConfigurationError: an option is unknown.
    """

    option_names = None  # checked by this backend itself (see the module docstring)

    name = "nixl"
    progress_driven = True

    def __new__(cls, config: TransportConfig) -> NixlTransport:
        # With lanes NIXL's own threads complete host transfers: that transport is not
        # progress-driven (a class attribute), so it is an instance of the subclass below.
        if cls is NixlTransport and _lanes_option(config) > 1:
            cls = _LanedNixlTransport
        return super().__new__(cls)

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        nixl = _import_nixl()
        self._lanes = _lanes_option(config)
        init: dict[str, str] = {"ucx_error_handling_mode": "none"}
        options = list(config.options)
        # NIXL 1.5.1's UCX plugin ignores its own `ucx_devices` parameter (it reads
        # `device_list`, appending ":1" to each name, which no tcp device matches), so the
        # devices reach UCX as its NET_DEVICES: checked by the UCX interfaces it opens.
        devices = config.option("ucx_devices")
        if devices is not None:
            if config.option("UCX_NET_DEVICES") is not None:
                raise ConfigurationError(
                    "nixl: options 'ucx_devices' and 'UCX_NET_DEVICES' both name UCX's devices; "
                    "give one"
                )
            options = [(k, v) for k, v in options if k != "ucx_devices"]
            options.append(("UCX_NET_DEVICES", devices))
        elif _is_loopback(config.listen_host) and config.option("UCX_NET_DEVICES") is None:
            options.append(("UCX_NET_DEVICES", "lo"))
        engine_config: list[str] = []
        ucx_environment: dict[str, str] = {}
        for key, value in options:
            if key.startswith("UCX_"):
                if "," in value:  # engine_config cuts at commas: see the module docstring
                    ucx_environment[key] = value
                else:
                    engine_config.append(f"{key.removeprefix('UCX_')}={value}")
            elif key in _PLUGIN_OPTIONS:
                init[key] = value
            elif key in _OWN_OPTIONS:
                continue
            else:
                raise ConfigurationError(
                    f"nixl: unknown option {key!r}; expected UCX_* or one of "
                    f"{(*_PLUGIN_OPTIONS, 'ucx_devices', *_OWN_OPTIONS)}"
                )
        if self._lanes > 1:
            init["num_threads"] = str(self._lanes)
            init["split_batch_size"] = "1"
        if engine_config:
            init["engine_config"] = ",".join(engine_config)
        given = config.option("segment_bytes") is not None
        segment = _positive_int_option(config, "segment_bytes", 1)
        self._segment_bytes = {
            mem: segment if given else default for mem, default in _DEFAULT_SEGMENT_BYTES.items()
        }
        window = _positive_int_option(config, "window", 1)
        self._window = window if config.option("window") is not None else _DEFAULT_WINDOW
        self._cuda = _has_cuda(config)
        if self._cuda:
            torch.cuda.set_device(config.device_index)
        self._agent_name = f"wt-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            with _process_environment(ucx_environment):
                self._agent = nixl.nixl_agent(
                    self._agent_name,
                    nixl.nixl_agent_config(enable_prog_thread=False, backends=[]),
                )
                self._agent.create_backend("UCX", init)
        except Exception as exc:  # nixl raises RuntimeError/nixlBind errors of several kinds
            raise TransportUnavailableError(
                f"transport 'nixl' could not start its UCX plugin: {exc}"
            ) from exc
        self._reg_descs: dict[int, Any] = {}
        self._by_peer: dict[str, _Peer] = {}
        self._prepared: collections.OrderedDict[tuple[Any, ...], _Prepared] = (
            collections.OrderedDict()
        )
        logger.debug("nixl agent %s up with UCX options %s", self._agent_name, init)

    # -- hooks ----------------------------------------------------------------------------

    def _capabilities(self) -> TransportCapabilities:
        kinds = {MemoryKind.HOST}
        if self._cuda:
            kinds.add(MemoryKind.CUDA)
        return TransportCapabilities(memory_kinds=frozenset(kinds), one_sided=True, cross_host=True)

    def _register(self, region_id: int, flat: torch.Tensor, role: RegionRole) -> Region:
        kind = MemoryKind.of(flat)
        device_id = flat.device.index if kind is MemoryKind.CUDA else 0
        mem_type = _MEM_TYPE[kind]
        try:
            reg = self._agent.register_memory(
                [(flat.data_ptr(), flat.numel(), device_id, "")], mem_type
            )
        except Exception as exc:  # nixlBind raises its own exception types
            raise TransportError(f"nixl: register_memory failed: {exc}") from exc
        descriptor = None
        if role is RegionRole.TARGET:
            partial = self._agent.get_partial_agent_metadata(reg, False)
            target = _Target(
                agent=self._agent_name,
                address=flat.data_ptr(),
                nbytes=flat.numel(),
                device_id=device_id,
                mem_type=mem_type,
                partial_md=bytes(partial),
            )
            descriptor = RegionDescriptor(
                backend=self.name, kind=kind, nbytes=flat.numel(), payload=_encode_payload(target)
            )
        self._reg_descs[region_id] = reg
        return Region.of(region_id, flat, role, descriptor)

    def _deregister(self, region: Region) -> None:
        for key in [k for k, p in self._prepared.items() if region.region_id in p.source_ids]:
            self._release_prepared(self._prepared.pop(key))
        self._agent.deregister_memory(self._reg_descs.pop(region.region_id))

    def _endpoint(self) -> bytes:
        metadata = bytes(self._agent.get_agent_metadata())
        data: bytes = msgpack.packb([_ENDPOINT_TAG, self._agent_name, metadata], use_bin_type=True)
        return data

    def _connect(self, peer: str, endpoint: bytes) -> None:
        try:
            obj = msgpack.unpackb(endpoint, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"nixl endpoint of peer {peer!r} is not valid msgpack: {exc}") from exc
        if not (
            isinstance(obj, list)
            and len(obj) == 3
            and obj[0] == _ENDPOINT_TAG
            and isinstance(obj[1], str)
            and isinstance(obj[2], bytes)
        ):
            raise ValueError(f"nixl endpoint of peer {peer!r} is malformed")
        _, agent, metadata = obj
        if any(p.agent == agent for p in self._by_peer.values()):
            raise ValueError(f"nixl agent {agent!r} of peer {peer!r} is already connected")
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as exc:  # nixlBind raises its own exception types
            raise PeerLostError(f"nixl: cannot load the metadata of peer {peer!r}: {exc}") from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != agent:
            self._agent.remove_remote_agent(loaded_name)
            raise ValueError(
                f"nixl endpoint of peer {peer!r} names agent {agent!r} but its metadata is "
                f"for {loaded_name!r}"
            )
        self._by_peer[peer] = _Peer(name=peer, agent=agent)

    def _disconnect(self, peer: str) -> None:
        state = self._by_peer.pop(peer)
        for key in [k for k in self._prepared if k[0] == peer]:
            self._release_prepared(self._prepared.pop(key))
        try:
            self._agent.remove_remote_agent(state.agent)
        except Exception as exc:  # nixlBind raises its own exception types
            logger.warning("nixl: removing the agent of peer %r failed: %s", peer, exc)

    def _post_writes(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        state = self._by_peer[peer]
        groups: dict[tuple[str, str], list[tuple[int, int, int, int, int, int]]] = {}
        sources: dict[tuple[str, str], set[int]] = {}
        for i, op in enumerate(ops):  # check everything before preparing or posting anything
            target = self._target(state, i, op)
            key = (_MEM_TYPE[op.source.kind], target.mem_type)
            groups.setdefault(key, []).append(
                (
                    op.source.address + op.source_offset,
                    op.source.device_index or 0,
                    target.address + op.target_offset,
                    target.device_id,
                    op.nbytes,
                    op.source.region_id,
                )
            )
            sources.setdefault(key, set()).add(op.source.region_id)
        batch = _Batch(todo=collections.deque(), running=[])
        try:
            for (src_type, dst_type), pieces in groups.items():
                for segment in self._segments(pieces, self._segment_bytes[src_type]):
                    if src_type == "DRAM" and self._lanes > 1:
                        segment = self._lane_order(segment, self._lanes)
                    batch.todo.append(
                        self._prepared_for(peer, state.agent, src_type, dst_type, segment)
                    )
            self._start_some(batch, peer)
        except Exception as exc:  # nixlBind raises its own exception types
            why = str(exc) if isinstance(exc, TransportError) else f"ERR ({exc})"
            if not batch.running:  # nothing of the batch started: refuse it here
                if isinstance(exc, TransportError):
                    raise
                raise TransportError(
                    f"nixl: posting writes to peer {peer!r} failed: {why}"
                ) from exc
            # Segments already started may still be running: the handle fails on its first
            # poll and settles once they stopped (`_quiesce`).
            batch.todo.clear()
            batch.failure = why
        handle.state = batch

    def _poll(self, handle: WriteHandle) -> bool:
        batch: _Batch = handle.state
        if batch.failure is not None:
            raise TransportError(f"nixl: writes to peer {handle.peer!r} failed: {batch.failure}")
        still: list[tuple[_Prepared, Any]] = []
        failure: str | None = None
        for prepared, xfer in batch.running:
            if failure is not None:
                still.append((prepared, xfer))
                continue
            try:
                status = self._agent.check_xfer_state(xfer)
            except Exception as exc:  # nixlBind raises its own exception types
                status = f"ERR ({exc})"
            if status == "DONE":
                prepared.busy -= 1
                prepared.idle.append(xfer)
            elif status == "PROC":
                still.append((prepared, xfer))
            else:
                failure = status
                still.append((prepared, xfer))
        batch.running = still
        if failure is None and batch.todo:
            try:
                self._start_some(batch, handle.peer)
            except TransportError as exc:
                failure = str(exc)
            except Exception as exc:  # nixlBind raises its own exception types
                failure = f"ERR ({exc})"
        if failure is not None:
            batch.todo.clear()
            batch.failure = failure
            raise TransportError(f"nixl: writes to peer {handle.peer!r} failed: {failure}")
        return not batch.running and not batch.todo

    def _quiesce(self, handle: WriteHandle) -> bool:
        # Release each started transfer of the failed batch once NIXL no longer reports it in
        # progress (done or failed); one still in PROC keeps the batch unsettled.
        batch: _Batch | None = handle.state
        if batch is None:
            return True
        still: list[tuple[_Prepared, Any]] = []
        stopped: list[tuple[_Prepared, Any]] = []
        for prepared, xfer in batch.running:
            try:
                status = self._agent.check_xfer_state(xfer)
            except Exception as exc:  # nixlBind raises its own exception types
                status = f"ERR ({exc})"
            (still if status == "PROC" else stopped).append((prepared, xfer))
        self._abandon(stopped)
        batch.running = still
        return not still

    def _start_some(self, batch: _Batch, peer: str) -> None:
        """Start segments while the window allows and this call has run < _START_BUDGET_S.

        Asynchronous lanes (cuda_ipc, RDMA) return from `transfer()` at once, so every segment
        of a batch starts in `post_writes`; a synchronous lane (cma on one host copies inside
        `transfer()`) starts one segment per call, so no call copies more than one segment.
        """
        deadline = time.perf_counter() + _START_BUDGET_S
        while batch.todo and (not self._window or len(batch.running) < self._window):
            self._start_next(batch, peer)
            if time.perf_counter() >= deadline:
                return

    def _start_next(self, batch: _Batch, peer: str) -> None:
        prepared = batch.todo.popleft()
        xfer = prepared.idle.pop() if prepared.idle else self._make_xfer(prepared)
        prepared.busy += 1
        batch.running.append((prepared, xfer))
        if self._agent.transfer(xfer) == "ERR":
            raise TransportError(f"nixl: posting writes to peer {peer!r} failed")

    @staticmethod
    def _segments(
        pieces: list[tuple[int, int, int, int, int, int]], limit: int
    ) -> list[list[tuple[int, int, int, int, int, int]]]:
        """Cut a group's writes into segments of at most `limit` bytes, splitting long ones
        (`limit` 0: one segment)."""
        if not limit:
            return [pieces]
        total = sum(piece[4] for piece in pieces)
        count = max(1, -(-total // limit))
        return _cut(pieces, [min(limit * k, total) for k in range(1, count + 1)])

    @staticmethod
    def _lane_order(
        segment: list[tuple[int, int, int, int, int, int]], lanes: int
    ) -> list[tuple[int, int, int, int, int, int]]:
        """Cut a segment into up to `lanes` runs of equal bytes (at least `_MIN_LANE_BYTES`
        each), pieces split at the run boundaries, and list the runs last first: NIXL merges
        list neighbours contiguous on both sides, which would join the lanes again."""
        total = sum(piece[4] for piece in segment)
        count = max(1, min(lanes, total // _MIN_LANE_BYTES))
        if count == 1:
            return segment
        runs = _cut(segment, [total * k // count for k in range(1, count + 1)])
        return [piece for run in reversed(runs) for piece in run]

    def _close(self) -> None:
        for prepared in self._prepared.values():
            self._release_prepared(prepared)
        self._prepared.clear()
        for peer in list(self._by_peer):
            self._disconnect(peer)
        for reg in self._reg_descs.values():
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:  # nixlBind raises its own exception types
                logger.warning("nixl: deregister_memory failed at close: %s", exc)
        self._reg_descs.clear()
        del self._agent

    # -- helpers --------------------------------------------------------------------------

    def _target(self, state: _Peer, i: int, op: WriteOp) -> _Target:
        """The decoded target of `op`, its metadata loaded into the agent; checked for `op`."""
        target = state.targets.get(op.target.payload)
        if target is None:
            target = _decode_payload(op.target.payload)
            if target.agent != state.agent:
                raise ValueError(
                    f"write {i} to {state.name!r}: the target region belongs to nixl agent "
                    f"{target.agent!r}, not to peer {state.name!r}"
                )
            try:
                self._agent.add_remote_agent(target.partial_md)
            except Exception as exc:  # nixlBind raises its own exception types
                raise TransportError(
                    f"nixl: write {i} to {state.name!r}: cannot load the target's metadata: {exc}"
                ) from exc
            state.targets[op.target.payload] = target
        if op.target_offset + op.nbytes > target.nbytes:
            # The payload holds what the target registered; an altered `nbytes` in the
            # descriptor must not let a write run past the registration.
            raise ValueError(
                f"write {i} to {state.name!r}: target range [{op.target_offset}, "
                f"{op.target_offset + op.nbytes}) is outside the {target.nbytes} bytes the peer "
                f"registered (the descriptor claims {op.target.nbytes})"
            )
        return target

    def _prepared_for(
        self,
        peer: str,
        agent: str,
        src_type: str,
        dst_type: str,
        segment: list[tuple[int, int, int, int, int, int]],
    ) -> _Prepared:
        local = tuple((src, n, src_dev) for src, src_dev, _, _, n, _ in segment)
        remote = tuple((dst, n, dst_dev) for _, _, dst, dst_dev, n, _ in segment)
        key = (peer, src_type, dst_type, local, remote)
        prepared = self._prepared.get(key)
        if prepared is not None:
            self._prepared.move_to_end(key)
            return prepared
        local_handle = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", list(local), src_type)
        try:
            remote_handle = self._agent.prep_xfer_dlist(agent, list(remote), dst_type)
        except Exception:
            local_handle.release()
            raise
        prepared = _Prepared(
            peer=peer,
            source_ids=frozenset(piece[5] for piece in segment),
            local=local_handle,
            remote=remote_handle,
            num_descs=len(segment),
        )
        self._prepared[key] = prepared
        self._evict()
        return prepared

    def _make_xfer(self, prepared: _Prepared) -> Any:
        indices = list(range(prepared.num_descs))
        return self._agent.make_prepped_xfer(
            "WRITE", prepared.local, indices, prepared.remote, indices
        )

    def _evict(self) -> None:
        """Drop least recently used prepared lists beyond the cap (never ones in flight)."""
        excess = len(self._prepared) - _MAX_CACHED_BATCHES
        for key in list(self._prepared):
            if excess <= 0:
                break
            if self._prepared[key].busy == 0:
                self._release_prepared(self._prepared.pop(key))
                excess -= 1

    def _abandon(self, pending: list[tuple[_Prepared, Any]]) -> None:
        """Release transfers that failed or will never be polled again."""
        for prepared, xfer in pending:
            prepared.busy -= 1
            try:
                xfer.release()
            except Exception as exc:  # nixlBind raises its own exception types
                logger.warning("nixl: releasing a transfer handle failed: %s", exc)

    def _release_prepared(self, prepared: _Prepared) -> None:
        for xfer in prepared.idle:
            xfer.release()
        prepared.idle.clear()
        for dlist in (prepared.local, prepared.remote):
            try:
                dlist.release()
            except Exception as exc:  # nixlBind raises its own exception types
                logger.warning("nixl: releasing a prepared descriptor list failed: %s", exc)


class _LanedNixlTransport(NixlTransport):
    """A `NixlTransport` with `lanes` > 1: NIXL's thread-pool engine completes transfers on its
    own threads, so `wait` polls with a short sleep instead of spinning (see Lanes)."""

    progress_driven = False
