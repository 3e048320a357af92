"""UCX backend: one-sided `ucp_put_nbx` into peers' memory with packed remote keys.

libucp is loaded through a small ctypes binding (`backends.ucx_native`; UCX 1.13 to 1.23) from
the build the option `library` names; ucx-py is no longer installable and ucxx exposes no RMA to
Python. Which build can do what (the `libucx-cu13` wheel has no RDMA lane at all) and what to
write for each: docs/ucx.md.

How a write travels: the target registers its memory with `ucp_mem_map` (host memory, or
`UCS_MEMORY_TYPE_CUDA` for GPU memory) and publishes the packed rkey plus the address in the
region descriptor. The initiator unpacks the rkey once per (peer, region), posts one
`ucp_put_nbx` per write, then one `ucp_ep_flush_nbx`; the batch is complete when the flush
completes, which UCX guarantees only after every earlier put on that endpoint is remotely
complete. On one host UCX moves host memory with `cma` (process_vm_writev) and GPU memory with
`cuda_ipc`, across hosts with RDMA where present: true one-sided lanes, the target runs no code.
Over UCX's `tcp` lane (two hosts without RDMA; `TLS=tcp`) and other lanes without a put of
their own (shared memory and cma before UCX 1.16), UCX emulates puts with messages that the
target's worker must progress; see `target_progress` below. `capabilities.one_sided` says which
of the two the configured lanes are (`ucx_native._tls.is_one_sided`).

Options (`TransportConfig.options`): `target_progress`, `lanes`, `library` and
`allow_tcp_only` are this backend's own; every other key is a UCX configuration variable, with
or without the `UCX_` prefix (`("TLS", "sm,cma,tcp")`, `("NET_DEVICES", "lo")`), applied with
`ucp_config_modify` (a transport's own option on UCX before 1.17: through the environment while
UCX creates its transports, `ucx_native.UcxWorker`); the library never reads the environment
for its own configuration (UCX still honours `UCX_*` variables that the process already has,
as `ucp_config_read` always does). If
`NET_DEVICES` is not given and `config.listen_host` is a loopback address (the default), the
backend sets `NET_DEVICES=lo`, so a default transport never sends a packet off this host.
Unless given, `CMA_SEG_SIZE=4M` and `CMA_TX_QUOTA=16` are set on UCX 1.17 and later (these
override `UCX_*` environment variables of the same names): one progress call then copies up to
4 MiB per put and up to 16 queued puts, instead of 512 KiB and one.

`library` = `auto` (default) | `wheel` | `system` | `nixl` | a folder holding libucp.so*: the
UCX build (`ucx_native._builds`). One build per process: a transport asking for another build
than the one this process loaded is refused in one line naming both (`auto` takes the loaded
one).

Lanes are checked before UCX starts, on the configuration UCX will use (options, environment,
config files; `ucx_native._tls.check`): a `TLS` lane the build lacks, or none of whose devices
`NET_DEVICES` allows, is refused naming the lane, the build (path, version) and what it has;
so are rc lanes without ud (UCP wires rc up over ud: `rc_verbs` alone never connects), ud over
an IPv4 GID on a non-Mellanox RoCE device before UCX 1.19 (it never receives there), and, where
the kernel lists an RDMA device, network lanes that would carry data between hosts over TCP
only, unless `allow_tcp_only` = `yes` (default `no`). Over rc lanes `connect` waits, up to
`connect_timeout_s`, until UCP has wired the endpoints (the target answers from its progress
thread), so the writes that follow need no CPU on the target.

`target_progress` = `auto` (default) | `on` | `off`: a daemon thread that progresses the
worker of a process holding TARGET regions, so emulated puts land. `auto` starts it when the
first TARGET region is registered (whatever the lanes: it costs nothing while no message
arrives), `on` at construction, `off` never (then only true one-sided lanes work; a tcp-lane
write into a target that runs no code never completes). Unless `off`, the context asks for
`UCP_FEATURE_WAKEUP` and the worker is `UCS_THREAD_MODE_SERIALIZED`: the thread progresses
until the worker is idle, arms the worker's event fd (`ucp_worker_arm`) and sleeps in
`poll()` on it for at most 100 ms, so an idle target wakes ten times a second. Every call on
the worker, from the thread or from the transport's methods, holds one lock, released while
the thread sleeps. `close()` stops the thread (woken with `ucp_worker_signal`, joined for at
most 2 s) before it tears the worker down.

Progress: UCX moves data only inside `ucp_worker_progress`, which this backend calls from
`post_writes` (a burst of at most 0.5 ms) and from `poll` (while there is progress, at most
4 ms); the class is `progress_driven`, so `Transport.wait` polls without sleeping. Puts are
posted in one tight loop with reused parameters; their requests are checked once, after the
flush posted behind them completed (a put's failure shows in its own request only).

Copy lanes (option `lanes` = `auto` (default: 2 where the machine has 2 or more CPUs, else 1)
or 1..16): one cma stream (process_vm_writev) is bounded by one CPU's copy speed, so an
initiator with N > 1 lanes owns N more workers on its context (created with
`mt_workers_shared`; one memory registration serves them all), one endpoint per (peer, lane)
with the target's rkeys unpacked on each, and one daemon thread per lane. A batch whose
sources are all host memory and that holds at least 4 MiB is cut into N contiguous shares of
whole pages in op order (an op is cut where a share ends; every byte still goes from the same
source address to the same target address); each lane thread posts its share's puts and a
flush on its endpoint and progresses its worker until they complete (ctypes drops the GIL in
`ucp_worker_progress`, so lanes copy in parallel), backing off up to 1 ms while nothing moves.
The handle completes when every lane's flush and puts did; a lane's error fails the batch
(`poll` raises `TransportError` naming the peer and the lane); `wait` sleeps on the batch's
completion event. Smaller batches and batches from GPU memory (cuda_ipc is asynchronous
already) take the single-worker path above. Lanes are made at the first `connect` (a process
that is only a target makes none); `close()` stops and joins them (at most 2 s each).

Failure model: endpoints use `UCP_ERR_HANDLING_MODE_NONE`, because asking UCX for peer error
handling turns puts into slow software emulation. UCX therefore never reports a dead peer;
a batch to a peer that died simply never completes, and `Transport.wait`'s timeout is what
detects it (`TransportTimeoutError` naming the peer). The same holds for a cut network link
under the tcp lane (tests/integration/test_netns.py runs ucx over a veth between two network
namespaces, cuts it, and sees update 2 time out naming the engine); TCP's retransmissions
carry the connection on once the link is back, so the next update succeeds without a reconnect.
When a batch does fail (a put refused while posting, the flush or a put completing with an
error), freeing its requests would not stop their operations: UCX would go on reading the
source memory. So the requests still in progress are kept and checked on every later poll
(`_quiesce`), and only once all of them finished is the batch settled (the Transport contract);
a copy lane reports its share failed only once its own requests finished.

Not thread-safe to drive from several threads, like every `Transport`; the backend's own
progress thread is safe against the one driving thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import ipaddress
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Mapping
from typing import cast

import msgpack
import torch

from weight_transfer.backends import availability
from weight_transfer.backends._memory import cut_at
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
    TransportUnavailableError,
    WriteHandle,
    WriteOp,
)

__all__ = ["UcxTransport"]

logger = logging.getLogger(__name__)

_PAGE_BYTES = 4096
_CLOSE_TIMEOUT_S = 5.0
_POLL_BUDGET_S = 0.004
_POST_BUDGET_S = 0.0005
_TARGET_PROGRESS = ("auto", "on", "off")
_OWN_OPTIONS = ("target_progress", "lanes", "library", "allow_tcp_only")
_YES_NO = ("yes", "no")
_DEFAULT_LANES = "auto"
_IDLE_WAIT_MS = 100
"""Longest the target progress thread sleeps on the worker's event fd before it looks again."""
_THREAD_JOIN_S = 2.0
_MAX_LANES = 16
_SPLIT_MIN_BYTES = 4 << 20
"""Host batches of at least this many bytes are split over the copy lanes; smaller ones are
posted inline on the main worker (a hand-off to lane threads costs more than it gains)."""
_LANE_BURST_S = 0.002
_LANE_IDLE_MAX_S = 0.001
_CMA_DEFAULTS = (("CMA_SEG_SIZE", "4M"), ("CMA_TX_QUOTA", "16"))
"""cma copies at most SEG_SIZE per queued put and TX_QUOTA queued puts per progress call (UCX's
defaults, 512K and 1, cost a progress call per 512 KiB and per small put); at most 64 MiB move
in one progress call."""
_CMA_DEFAULTS_SINCE = (1, 17)
"""UCX before 1.17 cannot take a transport's prefixed option (`CMA_SEG_SIZE`) through
`ucp_config_modify` (`uct_config_modify` ignored the prefix until 1.17; 1.13 warns "invalid
configurations" and drops it), and before 1.16 UCP does not put over cma anyway."""

try:  # the binding module itself imports only ctypes; libucp is loaded in the constructor
    from weight_transfer.backends import ucx_native
    from weight_transfer.backends.ucx_native import _tls as ucx_tls
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
    lane_rkeys: tuple[int, ...] = ()
    """The rkey unpacked on each copy lane's endpoint (empty with one lane)."""


@dataclasses.dataclass(slots=True)
class _Peer:
    name: str
    token: bytes
    ep: int
    targets: dict[bytes, _Target] = dataclasses.field(default_factory=dict)
    """This peer's regions with their unpacked rkeys, by descriptor payload."""
    lane_eps: list[int] = dataclasses.field(default_factory=list)
    """One endpoint per copy lane (empty with one lane)."""


@dataclasses.dataclass(slots=True)
class _RegionState:
    memh: int
    cuda: bool
    param: ctypes.Structure
    """Request parameters of puts from this region (built once, reused by every put)."""


@dataclasses.dataclass(slots=True)
class _Batch:
    puts: list[int]
    """Request pointers of puts UCX did not finish at once; settled after the flush."""
    flush: ucx_native.Request | None
    """The flush posted after the batch's puts; they are all complete once it is."""
    failure: str | None = None
    """Why the batch failed (a put refused while posting, the flush or a put failed). Its
    requests still in progress stay in `puts`/`flush` until they finish (`_quiet`): UCX may
    still read their memory, and freeing a request does not stop its operation."""


def _settle(worker: ucx_native.UcxWorker, batch: _Batch) -> bool:
    """True once the batch's flush and then every one of its puts completed; on a failure it
    sets `batch.failure` (and returns False), keeping the requests still in progress."""
    if batch.failure is None and batch.flush is not None:
        try:
            if worker.check(batch.flush):
                batch.flush = None
        except ucx_native.UcxError as exc:
            batch.flush = None  # check freed the failed flush; the puts stay (see `_quiet`)
            batch.failure = str(exc)
    if batch.failure is None and batch.flush is None and batch.puts:
        # Each put's own status: a failed put (peer gone) shows there, not in the flush.
        batch.puts, failed = worker.sweep(batch.puts)
        if failed is not None:
            batch.failure = str(failed)
    return batch.failure is None and batch.flush is None and not batch.puts


def _quiet(worker: ucx_native.UcxWorker, batch: _Batch) -> bool:
    """After a failure: True once no request of the batch is still in progress (each is
    freed as it finishes, whatever its status)."""
    if batch.flush is not None:
        try:
            if worker.check(batch.flush):
                batch.flush = None
        except ucx_native.UcxError:
            batch.flush = None
    if batch.puts:
        batch.puts, _ = worker.sweep(batch.puts)
    return batch.flush is None and not batch.puts


def _release(worker: ucx_native.UcxWorker, batch: _Batch) -> None:
    """Give up on a batch's requests (only when the worker is being torn down)."""
    worker.release_all(batch.puts)
    batch.puts = []
    if batch.flush is not None:
        worker.release(batch.flush)
        batch.flush = None


@dataclasses.dataclass(eq=False, slots=True)
class _LaneBatch:
    """A host batch split over the copy lanes: complete once every lane's job is."""

    remaining: int
    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    errors: list[str] = dataclasses.field(default_factory=list)

    def finish(self, error: str | None) -> None:
        with self.lock:
            if error is not None:
                self.errors.append(error)
            self.remaining -= 1
            if self.remaining == 0:
                self.event.set()


@dataclasses.dataclass(eq=False, slots=True)
class _LaneJob:
    """One lane's contiguous share of a `_LaneBatch`: puts, then a flush, on the lane's ep."""

    ep: int
    puts: list[tuple[int, int, int, int, ctypes.Structure]]
    batch: _LaneBatch
    work: _Batch = dataclasses.field(default_factory=lambda: _Batch(puts=[], flush=None))
    """The posted puts and flush, settled like an unsplit batch (`_settle`)."""


@dataclasses.dataclass(eq=False, slots=True)
class _Lane:
    """A copy lane: its own UCX worker on the shared context, driven by its own thread."""

    index: int
    worker: ucx_native.UcxWorker
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """Held around every call on `worker` (by the lane thread and by connect/close)."""
    jobs: queue.SimpleQueue[_LaneJob | None] = dataclasses.field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None
    stopping: bool = False


def _split_over_lanes(
    resolved: list[tuple[int, int, int, _Target, ctypes.Structure]], total: int, lanes: int
) -> list[list[tuple[int, int, int, int, ctypes.Structure]]]:
    """Cut the batch's byte sequence (ops in order) into `lanes` contiguous shares of whole
    pages, cutting ops where a share ends; each piece writes the same bytes to the same place
    as the op it came from. Shares may be empty at the end."""
    share = -(-total // lanes)
    share = -(-share // _PAGE_BYTES) * _PAGE_BYTES
    bounds = [min(share * k, total) for k in range(1, lanes)] + [total]
    return [
        [
            (
                resolved[i][0] + off,
                n,
                resolved[i][2] + off,
                resolved[i][3].lane_rkeys[lane],
                resolved[i][4],
            )  # fmt: skip
            for i, off, n in pieces
        ]
        for lane, pieces in enumerate(cut_at([r[1] for r in resolved], bounds))
    ]


def _parse_lanes(value: str) -> int:
    if value == "auto":
        return min(2, os.cpu_count() or 1)
    if not value.isdigit() or not 1 <= int(value) <= _MAX_LANES:
        raise ConfigurationError(
            f"ucx option lanes={value!r}: expected 'auto' or an integer from 1 to {_MAX_LANES}"
        )
    return int(value)


def _encode_payload(token: bytes, address: int, nbytes: int, rkey: bytes) -> bytes:
    return cast(bytes, msgpack.packb([token, address, nbytes, rkey], use_bin_type=True))


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


def _roce_ports() -> dict[str, ucx_tls.RocePort]:
    """The kernel's RDMA ports (link layer, GID table), by UCX's device name (`rxe0:1`)."""
    out: dict[str, ucx_tls.RocePort] = {}
    for device in availability.rdma_devices():
        ports_dir = os.path.join(availability.RDMA_SYSFS, device, "ports")
        try:
            ports = sorted(p for p in os.listdir(ports_dir) if p.isdigit())
        except OSError:
            continue
        for port in ports:
            base = os.path.join(ports_dir, port)
            try:
                with open(os.path.join(base, "link_layer")) as fh:
                    link_layer = fh.read().strip()
                gid_names = sorted(
                    (g for g in os.listdir(os.path.join(base, "gids")) if g.isdigit()), key=int
                )
            except OSError:
                continue
            gids = []
            for g in gid_names:
                try:
                    with open(os.path.join(base, "gids", g)) as fh:
                        gids.append(fh.read().strip())
                except OSError:  # an unused entry reads as an error on some kernels
                    gids.append("")
            out[f"{device}:{port}"] = ucx_tls.RocePort(device, int(port), link_layer, tuple(gids))
    return out


def _load_library(library: str, *, cuda: bool) -> ucx_native.LibUcp:
    """The UCX build the `library` option names, loaded (one build per process: the second,
    different one raises `UcxBuildConflictError`, a `ConfigurationError`)."""
    loaded = ucx_native.loaded()
    if library == "auto" and loaded is not None:
        return loaded  # auto takes the build this process already holds
    build = ucx_native.resolve(library, rdma=bool(availability.rdma_devices()), cuda=cuda)
    try:
        return ucx_native.load(build)
    except OSError as exc:
        raise TransportUnavailableError(
            f"transport 'ucx' could not load {build.label()}: {exc}"
        ) from exc


class UcxTransport(Transport):
    """UCX one-sided puts (libucp via ctypes). See the module docstring for the options.

    Raises (constructor):
        TransportUnavailableError: the `libucx` wheel is missing or libucp cannot start.
    """

    option_names = None  # checked by this backend itself (see the module docstring)

    name = "ucx"
    progress_driven = True

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        own = {k: v for k, v in config.options if k in _OWN_OPTIONS}
        options = [(k, v) for k, v in config.options if k not in _OWN_OPTIONS]
        self._target_progress = own.get("target_progress", "auto")
        self._num_lanes = _parse_lanes(own.get("lanes", _DEFAULT_LANES))
        if self._target_progress not in _TARGET_PROGRESS:
            raise ConfigurationError(
                f"ucx option target_progress={self._target_progress!r}: expected one of "
                f"{', '.join(_TARGET_PROGRESS)}"
            )
        allow_tcp_only = own.get("allow_tcp_only", "no")
        if allow_tcp_only not in _YES_NO:
            raise ConfigurationError(
                f"ucx option allow_tcp_only={allow_tcp_only!r}: expected yes or no"
            )
        threaded = self._target_progress != "off"
        keys = {k[4:] if k.startswith("UCX_") else k for k, _ in options}
        if "NET_DEVICES" not in keys and _is_loopback(config.listen_host):
            options.append(("NET_DEVICES", "lo"))
        self._cuda = config.device_index is not None and torch.cuda.is_available()
        if self._cuda:
            # UCX's CUDA transports work on the calling thread's current device.
            torch.cuda.set_device(config.device_index)
        lib = _load_library(own.get("library", "auto"), cuda=self._cuda)
        defaults = []
        if lib.version()[:2] >= _CMA_DEFAULTS_SINCE:
            defaults = [(k, v) for k, v in _CMA_DEFAULTS if k not in keys]
        self._one_sided = False
        self._wait_wireup = False

        def validate(values: Mapping[str, str]) -> None:
            # Checked on the configuration UCX will use (environment included), before the
            # context exists: a lane this build lacks is refused here, never left to UCX,
            # which would warn and carry on over what is left (TCP, say).
            try:
                resources = lib.resources()
            except OSError as exc:
                raise TransportUnavailableError(
                    f"ucx: cannot list the transports of {lib.describe()}: {exc}"
                ) from exc
            refusal = ucx_tls.check(
                resources,
                values,
                build=lib.describe(),
                rdma_devices=availability.rdma_devices(),
                allow_tcp_only=allow_tcp_only == "yes",
            )
            lanes = ucx_tls.enabled(resources, values)
            if refusal is None:
                refusal = ucx_tls.ud_gid_refusal(
                    lanes,
                    values,
                    version=lib.version(),
                    ports=_roce_ports(),
                    # UCX reads this transport option from the environment itself; looked at
                    # only to judge what UCX will do, never to configure anything.
                    gid_index=os.environ.get("UCX_IB_GID_INDEX"),
                    build=lib.describe(),
                )
            if refusal is not None:
                raise ConfigurationError(refusal)
            self._one_sided = ucx_tls.is_one_sided(lanes, values, lib.version())
            self._wait_wireup = ucx_tls.needs_wireup_reply(lanes)

        try:
            self._worker = ucx_native.UcxWorker(
                lib,
                options,
                name=f"wt-{os.getpid()}",
                defaults=defaults,
                wakeup=threaded,
                threaded=threaded,
                workers_shared=self._num_lanes > 1,
                validate=validate,
            )
        except ucx_native.UcxError as exc:
            given = ", ".join(f"{k}={v!r}" for k, v in config.options) or "none"
            raise TransportUnavailableError(
                f"transport 'ucx' could not start {lib.describe()}: {exc} (options given: {given})"
            ) from exc
        self._token = os.urandom(16)
        self._address = self._worker.address()
        self._region_state: dict[int, _RegionState] = {}
        self._by_peer: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        """Held around every call on `_worker` (the progress thread shares it)."""
        self._stopping = False
        """Set under `_lock` by close(); the progress thread touches the worker no more."""
        self._progress_thread: threading.Thread | None = None
        self._lanes: list[_Lane] = []
        """Copy lanes, made at the first connect when `lanes` > 1 (a target needs none)."""
        if self._target_progress == "on":
            self._start_target_progress()
        logger.debug("ucx transport up: %s, options %s", lib.describe(), options)

    # -- target-side progress ----------------------------------------------------------------

    def _start_target_progress(self) -> None:
        if self._progress_thread is not None:
            return
        try:
            fd = self._worker.efd()
        except ucx_native.UcxError as exc:
            raise TransportError(f"ucx: cannot start target-side progress: {exc}") from exc
        thread = threading.Thread(
            target=self._target_progress_loop, args=(fd,), name="ucx-target-progress", daemon=True
        )
        self._progress_thread = thread
        thread.start()

    def _target_progress_loop(self, fd: int) -> None:
        """Progress the worker whenever it has events, so that puts UCX emulates with messages
        (the tcp lane) land here; sleep on the worker's event fd otherwise."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        worker = self._worker
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    while worker.progress():
                        pass
                    armed = worker.arm()
                if armed:
                    poller.poll(_IDLE_WAIT_MS)
        except ucx_native.UcxError as exc:
            logger.error("ucx: target-side progress stopped: %s", exc)

    def _stop_target_progress(self) -> None:
        thread = self._progress_thread
        if thread is None:
            return
        with self._lock:
            self._stopping = True
            try:
                self._worker.signal()
            except ucx_native.UcxError as exc:
                logger.debug("ucx: waking the progress thread failed: %s", exc)
        thread.join(_THREAD_JOIN_S)
        if thread.is_alive():  # it cannot touch the worker any more (`_stopping`)
            logger.warning("ucx: the target progress thread did not stop in %.1f s", _THREAD_JOIN_S)
        self._progress_thread = None

    # -- hooks ----------------------------------------------------------------------------

    def _capabilities(self) -> TransportCapabilities:
        kinds = {MemoryKind.HOST}
        if self._cuda:
            kinds.add(MemoryKind.CUDA)
        return TransportCapabilities(
            memory_kinds=frozenset(kinds), one_sided=self._one_sided, cross_host=True
        )

    def _register(self, region_id: int, flat: torch.Tensor, role: RegionRole) -> Region:
        kind = MemoryKind.of(flat)
        cuda = kind is MemoryKind.CUDA
        prefault(flat)
        with self._lock:
            memh = self._worker.mem_map(flat.data_ptr(), flat.numel(), cuda=cuda)
        descriptor = None
        if role is RegionRole.TARGET:
            with self._lock:
                try:
                    rkey = self._worker.rkey_pack(memh)
                except ucx_native.UcxError:
                    self._worker.mem_unmap(memh)
                    raise
            if self._target_progress == "auto":
                self._start_target_progress()
            descriptor = RegionDescriptor(
                backend=self.name,
                kind=kind,
                nbytes=flat.numel(),
                payload=_encode_payload(self._token, flat.data_ptr(), flat.numel(), rkey),
            )
        self._region_state[region_id] = _RegionState(
            memh=memh, cuda=cuda, param=self._worker.put_param(memh, cuda)
        )
        return Region.of(region_id, flat, role, descriptor)

    def _deregister(self, region: Region) -> None:
        state = self._region_state.pop(region.region_id)
        with self._lock:
            self._worker.mem_unmap(state.memh)

    def _endpoint(self) -> bytes:
        return cast(bytes, msgpack.packb([self._token, self._address], use_bin_type=True))

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
        self._ensure_lanes()
        state = _Peer(name=peer, token=token, ep=0)
        try:
            with self._lock:
                state.ep = self._worker.ep_create(address)
            for lane in self._lanes:
                with lane.lock:
                    state.lane_eps.append(lane.worker.ep_create(address))
        except ucx_native.UcxError as exc:
            if state.ep:
                with self._lock:
                    self._drop_peer(state)
            raise PeerLostError(f"ucx: cannot reach peer {peer!r}: {exc}") from exc
        if self._wait_wireup:
            self._wire(state)
        self._by_peer[peer] = state

    def _wire(self, state: _Peer) -> None:
        """Wait until UCP has wired every endpoint to the peer (rc lanes connect endpoint to
        endpoint, after the peer answered UCP's wireup message): a flush completes only then.
        So a connected peer needs no CPU for the writes that follow, and a peer that cannot be
        reached fails here, named, within `connect_timeout_s`."""
        eps: list[tuple[ucx_native.UcxWorker, threading.Lock, int]] = [
            (self._worker, self._lock, state.ep)
        ]
        eps += [
            (lane.worker, lane.lock, ep)
            for lane, ep in zip(self._lanes, state.lane_eps, strict=True)
        ]
        deadline = time.monotonic() + self.config.connect_timeout_s
        pending: list[tuple[ucx_native.UcxWorker, threading.Lock, ucx_native.Request]] = []
        try:
            for worker, lock, ep in eps:
                with lock:
                    pending.append((worker, lock, worker.flush(ep)))
            while pending:
                still = []
                for worker, lock, req in pending:
                    with lock:
                        worker.progress()
                        if not worker.check(req):
                            still.append((worker, lock, req))
                pending = still
                if pending and time.monotonic() > deadline:
                    raise PeerLostError(
                        f"ucx: peer {state.name!r} did not complete UCX's connection (wireup) "
                        f"within {self.config.connect_timeout_s:g} s"
                    )
                if pending:
                    time.sleep(0.0005)
        except (ucx_native.UcxError, PeerLostError) as exc:
            for worker, lock, req in pending:
                with lock:
                    worker.release(req)
            with self._lock:
                self._drop_peer(state)
            if isinstance(exc, PeerLostError):
                raise
            raise PeerLostError(f"ucx: cannot connect to peer {state.name!r}: {exc}") from exc

    def _disconnect(self, peer: str) -> None:
        with self._lock:
            self._drop_peer(self._by_peer.pop(peer))

    def _post_writes(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        with self._lock:
            self._post_locked(peer, ops, handle)

    def _post_locked(self, peer: str, ops: list[WriteOp], handle: WriteHandle) -> None:
        state = self._by_peer[peer]
        resolved: list[tuple[int, int, int, _Target, ctypes.Structure]] = []
        targets = state.targets
        region_state = self._region_state
        host = True
        for i, op in enumerate(ops):  # resolve everything before posting anything
            target = targets.get(op.target.payload)
            if target is None:
                target = self._unpack_target(state, i, op)
            if op.target_offset + op.nbytes > target.nbytes:
                # The payload holds what the target registered; a descriptor whose `nbytes`
                # was altered must not let a write run past the registration.
                raise ValueError(
                    f"write {i} to {peer!r}: target range [{op.target_offset}, "
                    f"{op.target_offset + op.nbytes}) is outside the {target.nbytes} bytes the "
                    f"peer registered (the descriptor claims {op.target.nbytes})"
                )
            source = region_state[op.source.region_id]
            host = host and not source.cuda
            resolved.append(
                (
                    op.source.address + op.source_offset,
                    op.nbytes,
                    target.base + op.target_offset,
                    target,
                    source.param,
                )
            )
        if self._lanes and host and handle.nbytes >= _SPLIT_MIN_BYTES:
            self._post_lanes(state, resolved, handle)
            return
        puts: list[int] = []
        try:
            puts = self._worker.put_many(
                state.ep, [(a, n, r, t.rkey, p) for a, n, r, t, p in resolved]
            )
            flush = self._worker.flush(state.ep)
        except ucx_native.UcxError as exc:
            puts = puts or exc.pending
            if not puts:  # nothing of the batch runs: refuse it here
                raise TransportError(f"ucx: posting writes to {peer!r} failed: {exc}") from exc
            # Puts posted before the failure may still read their memory: the handle fails
            # on its first poll and settles once they finished (`_quiesce`).
            handle.state = _Batch(puts=puts, flush=None, failure=f"posting failed: {exc}")
            return
        batch = _Batch(puts=puts, flush=flush)
        handle.state = batch
        # Start moving data now: on one host UCX copies with cma inside progress calls, one
        # segment (UCX_CMA_SEG_SIZE) each; a short first burst overlaps the caller's next work.
        self._progress(batch, _POST_BUDGET_S)

    def _post_lanes(
        self,
        state: _Peer,
        resolved: list[tuple[int, int, int, _Target, ctypes.Structure]],
        handle: WriteHandle,
    ) -> None:
        shares = _split_over_lanes(resolved, handle.nbytes, len(self._lanes))
        used = [(lane, puts) for lane, puts in zip(self._lanes, shares, strict=True) if puts]
        batch = _LaneBatch(remaining=len(used))
        handle.state = batch
        for lane, puts in used:
            lane.jobs.put(_LaneJob(ep=state.lane_eps[lane.index], puts=puts, batch=batch))

    def _unpack_target(self, state: _Peer, i: int, op: WriteOp) -> _Target:
        token, base, length, packed = _decode_payload(op.target.payload)
        if token != state.token:
            raise ValueError(
                f"write {i} to {state.name!r}: the target region belongs to another ucx "
                f"endpoint, not to peer {state.name!r}"
            )
        lane_rkeys: list[int] = []
        try:
            rkey = self._worker.rkey_unpack(state.ep, packed)
            for lane in self._lanes:
                with lane.lock:
                    lane_rkeys.append(lane.worker.rkey_unpack(state.lane_eps[lane.index], packed))
        except ucx_native.UcxError as exc:
            raise TransportError(
                f"ucx: write {i} to {state.name!r}: cannot unpack the target's rkey: {exc}"
            ) from exc
        target = _Target(base=base, nbytes=length, rkey=rkey, lane_rkeys=tuple(lane_rkeys))
        state.targets[op.target.payload] = target
        return target

    def _progress(self, batch: _Batch, budget_s: float) -> None:
        """Progress the worker until the batch's flush completes, nothing moves, or the budget
        is spent."""
        progress = self._worker.progress
        deadline = time.perf_counter() + budget_s
        while batch.flush is not None and batch.flush.ptr is not None:
            if not progress() or time.perf_counter() >= deadline:
                return

    def _poll(self, handle: WriteHandle) -> bool:
        if isinstance(handle.state, _LaneBatch):
            batch = handle.state
            if not batch.event.is_set():
                time.sleep(0)  # a caller polling in a loop lets the lane threads take the GIL
                return False
            if batch.errors:
                raise TransportError(
                    f"ucx: writes to peer {handle.peer!r} failed: {'; '.join(batch.errors)}"
                )
            return True
        with self._lock:
            return self._poll_locked(handle)

    def _quiesce(self, handle: WriteHandle) -> bool:
        state = handle.state
        if isinstance(state, _LaneBatch):
            # A lane reports its share failed only once its requests finished (`_lane_loop`),
            # and the batch fails only once every lane reported.
            return state.event.is_set()
        if state is None:
            return True
        with self._lock:
            deadline = time.perf_counter() + _POLL_BUDGET_S
            while self._worker.progress() and time.perf_counter() < deadline:
                pass
            return _quiet(self._worker, state)

    def _completion_event(self, handle: WriteHandle) -> threading.Event | None:
        # Split batches complete on the lane threads: `wait` sleeps, leaving the CPUs to them.
        return handle.state.event if isinstance(handle.state, _LaneBatch) else None

    def _poll_locked(self, handle: WriteHandle) -> bool:
        batch: _Batch = handle.state
        # UCX moves a large put in fragments, one per progress call, and cma copies each
        # fragment inline. Progress while there is work, for at most _POLL_BUDGET_S, so a poll
        # advances a batch by megabytes yet stays short; `wait` polls without sleeping
        # (progress_driven).
        if batch.failure is None:
            self._progress(batch, _POLL_BUDGET_S)
        done = _settle(self._worker, batch)
        if batch.failure is not None:
            raise TransportError(f"ucx: writes to peer {handle.peer!r} failed: {batch.failure}")
        return done

    # -- copy lanes -------------------------------------------------------------------------

    def _ensure_lanes(self) -> None:
        """Make the copy lanes' workers and threads (once, before the first endpoint)."""
        if self._num_lanes < 2 or self._lanes:
            return
        try:
            with self._lock:
                for i in range(self._num_lanes):
                    self._lanes.append(_Lane(index=i, worker=self._worker.sibling(threaded=True)))
        except ucx_native.UcxError as exc:
            for lane in self._lanes:
                lane.worker.destroy()
            self._lanes.clear()
            raise TransportError(f"ucx: cannot create copy lane workers: {exc}") from exc
        for lane in self._lanes:
            lane.thread = threading.Thread(
                target=self._lane_loop, args=(lane,), name=f"ucx-lane-{lane.index}", daemon=True
            )
            lane.thread.start()

    def _lane_loop(self, lane: _Lane) -> None:
        """Post the jobs handed to this lane and progress its worker until they complete."""
        worker = lane.worker
        active: list[_LaneJob] = []
        failing: list[_LaneJob] = []
        """Jobs that failed but whose requests UCX still runs: reported once they finished."""
        idle = 0.0
        while True:
            new: list[_LaneJob | None] = [lane.jobs.get()] if not (active or failing) else []
            while True:
                try:
                    new.append(lane.jobs.get_nowait())
                except queue.Empty:
                    break
            with lane.lock:
                if lane.stopping or None in new:
                    for job in active + failing + [j for j in new if j is not None]:
                        self._lane_fail(lane, job, "the transport was closed")
                    return
                for posted in new:
                    assert posted is not None
                    try:
                        posted.work.puts = worker.put_many(posted.ep, posted.puts)
                        posted.work.flush = worker.flush(posted.ep)
                    except ucx_native.UcxError as exc:
                        posted.work.puts = posted.work.puts or exc.pending
                        posted.work.failure = str(exc)
                        failing.append(posted)
                        continue
                    active.append(posted)
                moved = 0
                deadline = time.perf_counter() + _LANE_BURST_S
                while active or failing:
                    n = worker.progress()
                    moved += n
                    if not n or time.perf_counter() >= deadline:
                        break
                still: list[_LaneJob] = []
                for job in active:
                    if _settle(worker, job.work):
                        job.batch.finish(None)
                    elif job.work.failure is not None:
                        failing.append(job)
                    else:
                        still.append(job)
                active = still
                # A failed share is reported only once none of its requests runs any more,
                # so a batch whose poll raises reads no memory (the Transport contract).
                quiet = [job for job in failing if _quiet(worker, job.work)]
                for job in quiet:
                    job.batch.finish(f"copy lane {lane.index}: {job.work.failure}")
                failing = [job for job in failing if job not in quiet]
            if (active or failing) and not moved:
                # Waiting on the peer (remote completions, the network): back off up to 1 ms.
                idle = min(idle * 2 or 1e-5, _LANE_IDLE_MAX_S)
                time.sleep(idle)
            else:
                idle = 0.0

    @staticmethod
    def _lane_fail(lane: _Lane, job: _LaneJob, why: str) -> None:
        """Give up on a job as the transport closes (its lane's lock held; the worker is torn
        down next) and report it on its batch."""
        _release(lane.worker, job.work)
        job.batch.finish(f"copy lane {lane.index}: {why}")

    def _stop_lanes(self) -> None:
        for lane in self._lanes:
            with lane.lock:
                lane.stopping = True
            lane.jobs.put(None)
        for lane in self._lanes:
            if lane.thread is not None:
                lane.thread.join(_THREAD_JOIN_S)
                if lane.thread.is_alive():  # it cannot touch the worker any more (`stopping`)
                    logger.warning("ucx: copy lane %d did not stop in %.1f s", lane.index,
                                   _THREAD_JOIN_S)  # fmt: skip

    # -- teardown ---------------------------------------------------------------------------

    def _drop_peer(self, state: _Peer) -> None:
        """Release a peer's rkeys and endpoints (`_lock` held; takes each lane's lock).

        Every endpoint's close is started first and all are then progressed together, so a
        peer that no longer answers costs one close timeout, not one per lane.
        """
        for target in state.targets.values():
            self._worker.rkey_destroy(target.rkey)
            for lane, rkey in zip(self._lanes, target.lane_rkeys, strict=False):
                with lane.lock:
                    lane.worker.rkey_destroy(rkey)
        state.targets.clear()
        closing: list[tuple[ucx_native.UcxWorker, threading.Lock | None, ucx_native.Request]] = []
        eps: list[tuple[ucx_native.UcxWorker, threading.Lock | None, int]] = []
        if state.ep:
            eps.append((self._worker, None, state.ep))
        for lane, ep in zip(self._lanes, state.lane_eps, strict=False):
            eps.append((lane.worker, lane.lock, ep))
        state.lane_eps.clear()
        for worker, lock, ep in eps:
            with lock or contextlib.nullcontext():
                try:
                    closing.append((worker, lock, worker.ep_close(ep)))
                except ucx_native.UcxError as exc:
                    logger.warning("ucx: closing an endpoint to %r failed: %s", state.name, exc)
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        while closing:
            still = []
            for worker, lock, req in closing:
                with lock or contextlib.nullcontext():
                    try:
                        worker.progress()
                        if not worker.check(req):
                            if time.monotonic() <= deadline:
                                still.append((worker, lock, req))
                                continue
                            logger.warning("ucx: closing an endpoint to %r timed out", state.name)
                            worker.release(req)
                    except ucx_native.UcxError as exc:
                        logger.warning("ucx: closing an endpoint to %r failed: %s", state.name, exc)
            closing = still

    def _close(self) -> None:
        self._stop_target_progress()
        self._stop_lanes()
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        try:
            for state in list(self._by_peer.values()):
                self._drop_peer(state)
            self._by_peer.clear()
            for lane in self._lanes:
                with lane.lock:
                    lane.worker.destroy()
            self._lanes.clear()
            for region_state in self._region_state.values():
                self._worker.mem_unmap(region_state.memh)
            self._region_state.clear()
        finally:
            self._worker.destroy()
