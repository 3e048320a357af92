"""Small Python objects over libucp (UCX 1.13 to 1.22): one context + worker, endpoints, memory,
rkeys.

This package is the only place that touches raw UCX handles; `backends.ucx` builds the
`Transport` on top of it. Every UCX status that is not OK raises `UcxError` (a
`TransportError`) carrying UCX's own text. Nothing here locks: a worker created with
`threaded=True` is in `UCS_THREAD_MODE_SERIALIZED`, and the caller (`backends.ucx`) serialises
every call on it with its own lock; otherwise (`UCS_THREAD_MODE_SINGLE`) one thread drives it.
`sibling()` makes another worker on the same context (one per copy lane; the context is then
created with `mt_workers_shared`), so one memory registration serves every lane.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable, Mapping

from weight_transfer.backends._environment import process_environment
from weight_transfer.backends.base import TransportError

from . import _libucp as L
from ._builds import LIBRARY_CHOICES, UcxBuild, resolve
from ._libucp import LibUcp, UcxBuildConflictError, load, loaded

__all__ = [
    "LIBRARY_CHOICES",
    "LibUcp",
    "Request",
    "UcxBuild",
    "UcxBuildConflictError",
    "UcxError",
    "UcxWorker",
    "load",
    "loaded",
    "resolve",
]

logger = logging.getLogger(__name__)


class UcxError(TransportError):
    """A libucp call returned an error status."""

    def __init__(self, what: str, status: int, text: str) -> None:
        self.status = status
        self.pending: list[int] = []
        """Requests of the failed call that UCX still runs (`put_many`): not freed, since
        UCX may still read their memory; the caller checks them with `sweep`."""
        super().__init__(f"{what} failed: {text} (ucs_status {status})")


class Request:
    """An in-flight UCX request (or one that completed immediately: `ptr` None)."""

    __slots__ = ("ptr", "status")

    def __init__(self, ptr: int | None, status: int) -> None:
        self.ptr = ptr
        self.status = status


class UcxWorker:
    """One UCX context with one worker, configured from `options` via `ucp_config_modify`.

    Args:
        lib: The loaded UCX build (`load`).
        options: UCX configuration as (name, value), names with or without the `UCX_` prefix
            (for example ("TLS", "sm,cma,tcp"), ("NET_DEVICES", "lo")). Applied through the
            config API; UCX itself still reads `UCX_*` environment variables of the process
            first, as it always does (`ucp_config_read`).
        name: A name for UCX's logs.
        defaults: Like `options`, applied first; one this UCX does not know (a transport
            module it lacks) is skipped with a debug log instead of failing.
        wakeup: Ask for `UCP_FEATURE_WAKEUP`, so `efd`/`arm`/`signal` work (a thread can sleep
            until the worker has events).
        threaded: Create the worker in `UCS_THREAD_MODE_SERIALIZED` (several threads, one at a
            time: the caller locks) instead of `UCS_THREAD_MODE_SINGLE`.
        workers_shared: Create the context with `mt_workers_shared`, so workers made by
            `sibling()` may be driven by different threads at once.
        validate: Called with the effective configuration (every `UCX_*` value as UCX will use
            it, environment and options applied, names without `UCX_`) before the context is
            created; whatever it raises propagates (nothing is left allocated).

    Raises:
        UcxError: UCX rejected an option or could not start.
    """

    def __init__(
        self,
        lib: LibUcp,
        options: Iterable[tuple[str, str]],
        name: str,
        defaults: Iterable[tuple[str, str]] = (),
        *,
        wakeup: bool = False,
        threaded: bool = False,
        workers_shared: bool = False,
        validate: Callable[[Mapping[str, str]], None] | None = None,
    ) -> None:
        self.lib = lib
        self._context = L.ucp_context_h()
        self._worker = L.ucp_worker_h()
        self._name = name.encode()
        self._owns_context = True
        self._environment: dict[str, str] = {}
        """Transport options this UCX takes only from the environment (`_apply_options`), set
        there while it creates its transports (context and workers)."""
        config = self._read_config(defaults, options, skip=())
        try:
            self.config = self.lib.config_values(config)
            """The effective UCX configuration of this worker's context, names without `UCX_`."""
            if validate is not None:
                validate(self.config)
            if self.lib.version()[:2] < L.PREFIXED_TRANSPORT_OPTIONS_SINCE:
                transport = self.lib.transport_options(config)
                if transport:
                    self.lib.ucp_config_release(config)
                    config = self._read_config(defaults, options, skip=transport)
                    self._environment = {f"UCX_{k}": v for k, v in transport.items()}
            params = L.ucp_params_t()
            params.field_mask = L.UCP_PARAM_FIELD_FEATURES | L.UCP_PARAM_FIELD_NAME
            params.features = L.UCP_FEATURE_RMA | (L.UCP_FEATURE_WAKEUP if wakeup else 0)
            params.name = self._name
            if workers_shared:
                params.field_mask |= L.UCP_PARAM_FIELD_MT_WORKERS_SHARED
                params.mt_workers_shared = 1
            api_major, api_minor = self.lib.api_version()
            with process_environment(self._environment):
                self._check(
                    "ucp_init",
                    self.lib.ucp_init_version(
                        api_major,
                        api_minor,
                        ctypes.byref(params),
                        config,
                        ctypes.byref(self._context),
                    ),
                )
        finally:
            self.lib.ucp_config_release(config)
        status = self._create_worker(threaded)
        if status != L.UCS_OK:
            self.lib.ucp_cleanup(self._context)
            self._context = L.ucp_context_h()
            self._check("ucp_worker_create", status)

    def _read_config(
        self,
        defaults: Iterable[tuple[str, str]],
        options: Iterable[tuple[str, str]],
        skip: Iterable[str],
    ) -> L.ucp_config_p:
        """A `ucp_config_t` read from the environment with `defaults` then `options` applied
        (except the names in `skip`); the caller releases it."""
        config = L.ucp_config_p()
        self._check("ucp_config_read", self.lib.ucp_config_read(None, None, ctypes.byref(config)))
        left_out = set(skip)
        try:
            for key, value in defaults:
                if key in left_out:
                    continue
                status = self.lib.ucp_config_modify(config, key.encode(), value.encode())
                if status != L.UCS_OK:
                    logger.debug("ucx: default %s=%s not applied: %s", key, value,
                                 self.lib.status_string(status))  # fmt: skip
            for key, value in options:
                ucx_key = key[4:] if key.startswith("UCX_") else key
                if ucx_key in left_out:
                    continue
                self._check(
                    f"ucp_config_modify({ucx_key}={value})",
                    self.lib.ucp_config_modify(config, ucx_key.encode(), value.encode()),
                )
        except BaseException:
            self.lib.ucp_config_release(config)
            raise
        return config

    def _create_worker(self, threaded: bool) -> int:
        wparams = L.ucp_worker_params_t()
        wparams.field_mask = L.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        wparams.thread_mode = L.UCS_THREAD_MODE_SERIALIZED if threaded else L.UCS_THREAD_MODE_SINGLE
        with process_environment(self._environment):  # the worker opens the transports
            return int(
                self.lib.ucp_worker_create(
                    self._context, ctypes.byref(wparams), ctypes.byref(self._worker)
                )
            )

    def sibling(self, threaded: bool = False) -> UcxWorker:
        """Another worker on this worker's context (its registrations are valid there too).

        Destroy it before this one. Driving it from another thread than this worker's needs a
        context made with `workers_shared=True`.

        Raises:
            UcxError: UCX could not create the worker.
        """
        other = UcxWorker.__new__(UcxWorker)
        other.lib = self.lib
        other.config = self.config
        other._environment = self._environment
        other._context = self._context
        other._worker = L.ucp_worker_h()
        other._name = self._name
        other._owns_context = False
        other._check("ucp_worker_create", other._create_worker(threaded))
        return other

    # -- helpers --------------------------------------------------------------------------

    def _check(self, what: str, status: int) -> None:
        if status != L.UCS_OK:
            raise UcxError(what, status, self.lib.status_string(status))

    def _request(self, what: str, ptr: int | None) -> Request:
        if L.ptr_is_err(ptr):
            status = L.ptr_status(ptr)
            raise UcxError(what, status, self.lib.status_string(status))
        if ptr is None:
            return Request(None, L.UCS_OK)
        return Request(ptr, L.UCS_INPROGRESS)

    # -- worker ---------------------------------------------------------------------------

    def address(self) -> bytes:
        """The worker's address, for a peer's `ep_create`."""
        addr = L.ucp_address_p()
        length = ctypes.c_size_t()
        self._check(
            "ucp_worker_get_address",
            self.lib.ucp_worker_get_address(self._worker, ctypes.byref(addr), ctypes.byref(length)),
        )
        try:
            return ctypes.string_at(addr, length.value)
        finally:
            self.lib.ucp_worker_release_address(self._worker, addr)

    def progress(self) -> int:
        """Drive communication once; returns how many events were processed."""
        return int(self.lib.ucp_worker_progress(self._worker))

    def efd(self) -> int:
        """The worker's event file descriptor (needs `wakeup=True`); UCX owns it."""
        fd = ctypes.c_int(-1)
        self._check(
            "ucp_worker_get_efd", self.lib.ucp_worker_get_efd(self._worker, ctypes.byref(fd))
        )
        return fd.value

    def arm(self) -> bool:
        """Arm the event fd; False if events are pending (progress, then arm again)."""
        status = int(self.lib.ucp_worker_arm(self._worker))
        if status == L.UCS_ERR_BUSY:
            return False
        self._check("ucp_worker_arm", status)
        return True

    def signal(self) -> None:
        """Make the event fd readable now (wakes a thread sleeping on it)."""
        self._check("ucp_worker_signal", self.lib.ucp_worker_signal(self._worker))

    # -- memory ---------------------------------------------------------------------------

    def mem_map(self, address: int, nbytes: int, cuda: bool) -> int:
        """Register `nbytes` at `address` for local and remote access; returns the memh."""
        params = L.ucp_mem_map_params_t()
        params.field_mask = (
            L.UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | L.UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | L.UCP_MEM_MAP_PARAM_FIELD_PROT
            | L.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
        )
        params.address = address
        params.length = nbytes
        params.prot = (
            L.UCP_MEM_MAP_PROT_LOCAL_READ
            | L.UCP_MEM_MAP_PROT_LOCAL_WRITE
            | L.UCP_MEM_MAP_PROT_REMOTE_READ
            | L.UCP_MEM_MAP_PROT_REMOTE_WRITE
        )
        params.memory_type = L.UCS_MEMORY_TYPE_CUDA if cuda else L.UCS_MEMORY_TYPE_HOST
        memh = L.ucp_mem_h()
        self._check(
            "ucp_mem_map",
            self.lib.ucp_mem_map(self._context, ctypes.byref(params), ctypes.byref(memh)),
        )
        assert memh.value is not None
        return memh.value

    def mem_unmap(self, memh: int) -> None:
        """Release a registration made by `mem_map`."""
        self._check("ucp_mem_unmap", self.lib.ucp_mem_unmap(self._context, memh))

    def rkey_pack(self, memh: int) -> bytes:
        """The packed remote key of a registration, for a peer's `rkey_unpack`."""
        buf = ctypes.c_void_p()
        size = ctypes.c_size_t()
        self._check(
            "ucp_rkey_pack",
            self.lib.ucp_rkey_pack(self._context, memh, ctypes.byref(buf), ctypes.byref(size)),
        )
        try:
            return ctypes.string_at(buf, size.value)
        finally:
            self.lib.ucp_rkey_buffer_release(buf)

    # -- endpoints ------------------------------------------------------------------------

    def ep_create(self, address: bytes) -> int:
        """An endpoint to the worker at `address`, without peer error handling.

        UCP_ERR_HANDLING_MODE_NONE keeps zero-copy one-sided lanes (cma, cuda_ipc, RDMA)
        available; with PEER mode UCX drops to software-emulated puts. The price: UCX does not
        report a dead peer, so callers detect peer loss by their own timeouts.
        """
        addr_buf = ctypes.create_string_buffer(address, len(address))
        params = L.ucp_ep_params_t()
        params.field_mask = (
            L.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | L.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        )
        params.address = ctypes.cast(addr_buf, ctypes.c_void_p)
        params.err_mode = L.UCP_ERR_HANDLING_MODE_NONE
        ep = L.ucp_ep_h()
        self._check(
            "ucp_ep_create",
            self.lib.ucp_ep_create(self._worker, ctypes.byref(params), ctypes.byref(ep)),
        )
        assert ep.value is not None
        return ep.value

    def ep_close(self, ep: int) -> Request:
        """Start closing an endpoint, flushing it first.

        (UCX allows a forced close only on endpoints created with peer error handling, which
        this binding never uses.)
        """
        param = L.ucp_request_param_t()
        return self._request("ucp_ep_close_nbx", self.lib.ucp_ep_close_nbx(ep, ctypes.byref(param)))

    def rkey_unpack(self, ep: int, packed: bytes) -> int:
        """Unpack a peer's packed rkey for use on `ep`."""
        rkey = L.ucp_rkey_h()
        self._check(
            "ucp_ep_rkey_unpack",
            self.lib.ucp_ep_rkey_unpack(ep, packed, ctypes.byref(rkey)),
        )
        assert rkey.value is not None
        return rkey.value

    def rkey_destroy(self, rkey: int) -> None:
        """Release an unpacked rkey."""
        self.lib.ucp_rkey_destroy(rkey)

    # -- data path ------------------------------------------------------------------------

    def put(
        self,
        ep: int,
        address: int,
        nbytes: int,
        remote_address: int,
        rkey: int,
        memh: int,
        cuda: bool,
    ) -> Request:
        """Post a one-sided put of local [address, address+nbytes) (inside `memh`)."""
        param = L.ucp_request_param_t()
        param.op_attr_mask = L.UCP_OP_ATTR_FIELD_MEMH | L.UCP_OP_ATTR_FIELD_MEMORY_TYPE
        param.memh = memh
        param.memory_type = L.UCS_MEMORY_TYPE_CUDA if cuda else L.UCS_MEMORY_TYPE_HOST
        return self._request(
            "ucp_put_nbx",
            self.lib.ucp_put_nbx(ep, address, nbytes, remote_address, rkey, ctypes.byref(param)),
        )

    def put_param(self, memh: int, cuda: bool) -> ctypes.Structure:
        """Request parameters for puts from the registration `memh`, built once and reused."""
        param = L.ucp_request_param_t()
        param.op_attr_mask = L.UCP_OP_ATTR_FIELD_MEMH | L.UCP_OP_ATTR_FIELD_MEMORY_TYPE
        param.memh = memh
        param.memory_type = L.UCS_MEMORY_TYPE_CUDA if cuda else L.UCS_MEMORY_TYPE_HOST
        return param

    def put_many(
        self, ep: int, puts: Iterable[tuple[int, int, int, int, ctypes.Structure]]
    ) -> list[int]:
        """Post puts `(address, nbytes, remote_address, rkey, param)` on `ep`.

        The fast path for batches: one foreign call per put, `param` from `put_param`.
        Returns the request pointers of the puts UCX did not finish at once; check them with
        `settle` once a flush posted after them completed (a put's own failure, a dead peer
        say, shows only in its request, not in the flush).

        Raises:
            UcxError: a put was refused. The puts before it are already posted and may still
                read their memory: the error's `pending` holds their requests, not freed
                (check them with `sweep` until none is left).
        """
        put = self.lib.ucp_put_nbx
        err_floor = L.UCS_ERR_LAST & 0xFFFFFFFFFFFFFFFF
        pending: list[int] = []
        for address, nbytes, remote, rkey, param in puts:
            ptr = put(ep, address, nbytes, remote, rkey, ctypes.byref(param))
            if ptr is not None:
                if ptr >= err_floor:
                    try:
                        self._request("ucp_put_nbx", ptr)  # raises with UCX's text
                    except UcxError as exc:
                        exc.pending = pending
                        raise
                pending.append(ptr)
        return pending

    def sweep(self, requests: list[int]) -> tuple[list[int], UcxError | None]:
        """Free the requests of `requests` that finished; return those still in progress
        (never freed: UCX may still read their memory) and the first failure, if any."""
        check = self.lib.ucp_request_check_status
        free = self.lib.ucp_request_free
        still: list[int] = []
        failure: UcxError | None = None
        for ptr in requests:
            status = int(check(ptr))
            if status == L.UCS_INPROGRESS:
                still.append(ptr)
                continue
            free(ptr)
            if status != L.UCS_OK and failure is None:
                failure = UcxError("UCX put", status, self.lib.status_string(status))
        return still, failure

    def release_all(self, requests: list[int]) -> None:
        """Give up on raw request pointers (as `release` does for a `Request`)."""
        for ptr in requests:
            self.release(Request(ptr, L.UCS_INPROGRESS))

    def flush(self, ep: int) -> Request:
        """Post a flush: completes once every earlier operation on `ep` is remotely complete."""
        param = L.ucp_request_param_t()
        return self._request("ucp_ep_flush_nbx", self.lib.ucp_ep_flush_nbx(ep, ctypes.byref(param)))

    def check(self, request: Request) -> bool:
        """True once `request` completed (and freed); raises UcxError if it failed."""
        if request.ptr is None:
            return True
        status = int(self.lib.ucp_request_check_status(request.ptr))
        if status == L.UCS_INPROGRESS:
            return False
        self.lib.ucp_request_free(request.ptr)
        request.ptr = None
        request.status = status
        self._check("UCX request", status)
        return True

    def release(self, request: Request) -> None:
        """Give up on a request: cancel it if still running, then free it."""
        if request.ptr is None:
            return
        if int(self.lib.ucp_request_check_status(request.ptr)) == L.UCS_INPROGRESS:
            self.lib.ucp_request_cancel(self._worker, request.ptr)
        self.lib.ucp_request_free(request.ptr)
        request.ptr = None

    # -- teardown -------------------------------------------------------------------------

    def destroy(self) -> None:
        """Destroy the worker and (unless it is a `sibling`) the context. Idempotent."""
        if self._worker.value:
            self.lib.ucp_worker_destroy(self._worker)
            self._worker = L.ucp_worker_h()
        if self._context.value and self._owns_context:
            self.lib.ucp_cleanup(self._context)
        self._context = L.ucp_context_h()
