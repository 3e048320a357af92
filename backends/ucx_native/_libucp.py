"""Typed ctypes binding of the part of libucp that one-sided writes need (UCX 1.13 to 1.22).

Struct layouts and constants follow UCX 1.22's headers (the `libucx-cu13` 1.22.0 wheel's
`include/ucp/api/ucp.h`, `ucp_def.h`, `ucs/type/status.h`, `ucs/memory/memory_type.h`), and
every struct, field, constant and function bound here was checked against UCX 1.13's headers
too (Debian's libucx-dev 1.13.1). The differences are explicit: UCX grew three structs at their
ends after 1.13 (`FIELDS_AFTER_1_13`), and this binding never sets those fields, so the larger
1.22 structs are valid for 1.13 as well (UCX reads a field only when its bit is in the struct's
field mask). Nothing else bound here differs. `tests/unit/test_ucx_binding.py` pins every size
and field offset to what gcc reports for both header sets on x86_64, so a drift fails a test
instead of corrupting memory. Nothing here is public API: `backends.ucx` is the only user.

The library is loaded lazily (`load(build)`), never at import time, from the folder of the
build the ucx backend's `library` option chose (`_builds`), dependencies first and each by its
full path (`_uct.open_build`), so libucp's libucs, libuct and libucm and its transport modules
all come from that one build. One build per process: a second, different build is refused
(`UcxBuildConflictError`), because two copies of UCX in one process each install their memory
hooks and global state over the other's.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import (
    POINTER,
    Structure,
    Union,
    c_char_p,
    c_int,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import TYPE_CHECKING, Any

from weight_transfer.backends.ucx_native import _uct
from weight_transfer.errors import ConfigurationError

if TYPE_CHECKING:
    from weight_transfer.backends.ucx_native._builds import UcxBuild

# -- API versions (ucp_version.h) -----------------------------------------------------------------
UCP_API_MAJOR = 1
UCP_API_MINOR = 22
"""The newest UCP API this binding was written against (its struct layouts)."""
MIN_VERSION = (1, 13)
"""The oldest UCX this binding was checked against (headers and runs: Debian's 1.13.1)."""

FIELDS_AFTER_1_13: dict[str, tuple[str, ...]] = {
    "ucp_params_t": ("node_local_id",),
    "ucp_mem_map_params_t": ("exported_memh_buffer",),
    "ucp_request_param_t": ("remote_datatype", "remote", "remote_count"),
}
"""Fields of the structs below that UCX 1.13's headers lack (all at the structs' ends). The
binding never sets them (nor their field-mask bits), so the 1.22 layouts serve 1.13 too."""

PREFIXED_TRANSPORT_OPTIONS_SINCE = (1, 17)
"""UCX before 1.17 keeps a transport option given to `ucp_config_modify` (`IB_GID_INDEX`,
`CMA_SEG_SIZE`) but cannot apply it: its `uct_config_modify` ignores the transport's prefix, and
UCP warns "invalid configuration" and drops it. Such options then go to UCX through the
environment while it creates its transports (`UcxWorker`), where UCX reads them itself."""

# -- ucs_config_print_flags_t (ucs/config/types.h) ------------------------------------------------
UCS_CONFIG_PRINT_CONFIG = 1 << 0

# -- ucs_status_t (ucs/type/status.h) -----------------------------------------------------------
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_NO_RESOURCE = -2
UCS_ERR_BUSY = -15
UCS_ERR_CANCELED = -16
UCS_ERR_LAST = -100

# -- ucs_memory_type_t (ucs/memory/memory_type.h) ------------------------------------------------
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

# -- ucs_thread_mode_t ---------------------------------------------------------------------------
UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_SERIALIZED = 1
UCS_THREAD_MODE_MULTI = 2

# -- ucp_params_field / ucp_feature --------------------------------------------------------------
UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1 << 5
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4

# -- ucp_worker_params_field ---------------------------------------------------------------------
UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0

# -- ucp_ep_params_field / ucp_err_handling_mode_t -----------------------------------------------
UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1

# -- ucp_ep_close_flags_t ------------------------------------------------------------------------
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

# -- ucp_mem_map_params_field / flags / prot -----------------------------------------------------
UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_FLAGS = 1 << 2
UCP_MEM_MAP_PARAM_FIELD_PROT = 1 << 3
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4
UCP_MEM_MAP_PROT_LOCAL_READ = 1 << 0
UCP_MEM_MAP_PROT_LOCAL_WRITE = 1 << 1
UCP_MEM_MAP_PROT_REMOTE_READ = 1 << 8
UCP_MEM_MAP_PROT_REMOTE_WRITE = 1 << 9

# -- ucp_op_attr_t -------------------------------------------------------------------------------
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
UCP_OP_ATTR_FIELD_MEMH = 1 << 8

# -- opaque handles ------------------------------------------------------------------------------
ucp_config_p = c_void_p
ucp_context_h = c_void_p
ucp_worker_h = c_void_p
ucp_ep_h = c_void_p
ucp_mem_h = c_void_p
ucp_rkey_h = c_void_p
ucp_address_p = c_void_p
ucs_status_t = c_int
ucs_status_ptr_t = c_void_p


class ucp_params_t(Structure):
    """`struct ucp_params` (ucp.h)."""

    _fields_ = [
        ("field_mask", c_uint64),
        ("features", c_uint64),
        ("request_size", c_size_t),
        ("request_init", c_void_p),
        ("request_cleanup", c_void_p),
        ("tag_sender_mask", c_uint64),
        ("mt_workers_shared", c_int),
        ("estimated_num_eps", c_size_t),
        ("estimated_num_ppn", c_size_t),
        ("name", c_char_p),
        ("node_local_id", c_size_t),
    ]


class ucs_cpu_set_t(Structure):
    """`ucs_cpu_set_t`: UCS_CPU_SETSIZE (1024) bits."""

    _fields_ = [("ucs_bits", c_uint64 * 16)]


class ucp_worker_params_t(Structure):
    """`struct ucp_worker_params` (ucp.h)."""

    _fields_ = [
        ("field_mask", c_uint64),
        ("thread_mode", c_int),
        ("cpu_mask", ucs_cpu_set_t),
        ("events", c_uint),
        ("user_data", c_void_p),
        ("event_fd", c_int),
        ("flags", c_uint64),
        ("name", c_char_p),
        ("am_alignment", c_size_t),
        ("client_id", c_uint64),
    ]


class ucp_err_handler_t(Structure):
    """`struct ucp_err_handler` (ucp_def.h)."""

    _fields_ = [("cb", c_void_p), ("arg", c_void_p)]


class ucs_sock_addr_t(Structure):
    """`ucs_sock_addr_t` (ucs/type/status.h neighbour: a sockaddr pointer and its length)."""

    _fields_ = [("addr", c_void_p), ("addrlen", c_uint32)]


class ucp_ep_params_t(Structure):
    """`struct ucp_ep_params` (ucp_def.h)."""

    _fields_ = [
        ("field_mask", c_uint64),
        ("address", ucp_address_p),
        ("err_mode", c_int),
        ("err_handler", ucp_err_handler_t),
        ("user_data", c_void_p),
        ("flags", c_uint),
        ("sockaddr", ucs_sock_addr_t),
        ("conn_request", c_void_p),
        ("name", c_char_p),
        ("local_sockaddr", ucs_sock_addr_t),
    ]


class ucp_mem_map_params_t(Structure):
    """`struct ucp_mem_map_params` (ucp.h)."""

    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("flags", c_uint),
        ("prot", c_uint),
        ("memory_type", c_int),
        ("exported_memh_buffer", c_void_p),
    ]


class _request_cb_t(Union):
    _fields_ = [("send", c_void_p)]


class _recv_info_t(Union):
    _fields_ = [("length", c_void_p)]


class ucp_request_param_t(Structure):
    """`ucp_request_param_t` (ucp.h)."""

    _fields_ = [
        ("op_attr_mask", c_uint32),
        ("flags", c_uint32),
        ("request", c_void_p),
        ("cb", _request_cb_t),
        ("datatype", c_uint64),
        ("user_data", c_void_p),
        ("reply_buffer", c_void_p),
        ("memory_type", c_int),
        ("recv_info", _recv_info_t),
        ("memh", ucp_mem_h),
        ("remote_datatype", c_uint64),
        ("remote", c_void_p),
        ("remote_count", c_size_t),
    ]


STRUCTS: dict[str, type[Structure]] = {
    "ucp_params_t": ucp_params_t,
    "ucp_worker_params_t": ucp_worker_params_t,
    "ucp_ep_params_t": ucp_ep_params_t,
    "ucp_mem_map_params_t": ucp_mem_map_params_t,
    "ucp_request_param_t": ucp_request_param_t,
}
"""Every struct passed to libucp, by its C name (the layout test walks this table)."""


def ptr_is_err(ptr: int | None) -> bool:
    """`UCS_PTR_IS_ERR`: the status pointer encodes an error code."""
    return ptr is not None and ptr >= (UCS_ERR_LAST & 0xFFFFFFFFFFFFFFFF)


def ptr_status(ptr: int | None) -> int:
    """`UCS_PTR_STATUS`: the status a status pointer encodes (UCS_OK for NULL)."""
    if ptr is None:
        return UCS_OK
    return ctypes.c_int64(ptr).value


class LibUcp:
    """Function prototypes of libucp/libucs, bound once per process."""

    def __init__(self, build: UcxBuild, libs: dict[str, ctypes.CDLL]) -> None:
        self.build = build
        self._ucp = ucp = libs["ucp"]
        self._ucs = ucs = libs["ucs"]
        self._uct = libs["uct"]
        self._resources: list[_uct.Resource] | None = None
        p = POINTER
        self.ucp_get_version = self._fn(ucp, "ucp_get_version", None, [p(c_uint)] * 3)
        self.ucp_config_read = self._fn(
            ucp, "ucp_config_read", ucs_status_t, [c_char_p, c_char_p, p(ucp_config_p)]
        )
        self.ucp_config_modify = self._fn(
            ucp, "ucp_config_modify", ucs_status_t, [ucp_config_p, c_char_p, c_char_p]
        )
        self.ucp_config_release = self._fn(ucp, "ucp_config_release", None, [ucp_config_p])
        self.ucp_config_print = self._fn(
            ucp, "ucp_config_print", None, [ucp_config_p, c_void_p, c_char_p, c_int]
        )
        self.ucp_init_version = self._fn(
            ucp,
            "ucp_init_version",
            ucs_status_t,
            [c_uint, c_uint, p(ucp_params_t), ucp_config_p, p(ucp_context_h)],
        )
        self.ucp_cleanup = self._fn(ucp, "ucp_cleanup", None, [ucp_context_h])
        self.ucp_worker_create = self._fn(
            ucp,
            "ucp_worker_create",
            ucs_status_t,
            [ucp_context_h, p(ucp_worker_params_t), p(ucp_worker_h)],
        )
        self.ucp_worker_destroy = self._fn(ucp, "ucp_worker_destroy", None, [ucp_worker_h])
        self.ucp_worker_get_address = self._fn(
            ucp,
            "ucp_worker_get_address",
            ucs_status_t,
            [ucp_worker_h, p(ucp_address_p), p(c_size_t)],
        )
        self.ucp_worker_release_address = self._fn(
            ucp, "ucp_worker_release_address", None, [ucp_worker_h, ucp_address_p]
        )
        self.ucp_worker_progress = self._fn(ucp, "ucp_worker_progress", c_uint, [ucp_worker_h])
        self.ucp_worker_get_efd = self._fn(
            ucp, "ucp_worker_get_efd", ucs_status_t, [ucp_worker_h, p(c_int)]
        )
        self.ucp_worker_arm = self._fn(ucp, "ucp_worker_arm", ucs_status_t, [ucp_worker_h])
        self.ucp_worker_signal = self._fn(ucp, "ucp_worker_signal", ucs_status_t, [ucp_worker_h])
        self.ucp_ep_create = self._fn(
            ucp, "ucp_ep_create", ucs_status_t, [ucp_worker_h, p(ucp_ep_params_t), p(ucp_ep_h)]
        )
        self.ucp_ep_close_nbx = self._fn(
            ucp, "ucp_ep_close_nbx", ucs_status_ptr_t, [ucp_ep_h, p(ucp_request_param_t)]
        )
        self.ucp_ep_flush_nbx = self._fn(
            ucp, "ucp_ep_flush_nbx", ucs_status_ptr_t, [ucp_ep_h, p(ucp_request_param_t)]
        )
        self.ucp_mem_map = self._fn(
            ucp,
            "ucp_mem_map",
            ucs_status_t,
            [ucp_context_h, p(ucp_mem_map_params_t), p(ucp_mem_h)],
        )
        self.ucp_mem_unmap = self._fn(
            ucp, "ucp_mem_unmap", ucs_status_t, [ucp_context_h, ucp_mem_h]
        )
        self.ucp_rkey_pack = self._fn(
            ucp,
            "ucp_rkey_pack",
            ucs_status_t,
            [ucp_context_h, ucp_mem_h, p(c_void_p), p(c_size_t)],
        )
        self.ucp_rkey_buffer_release = self._fn(ucp, "ucp_rkey_buffer_release", None, [c_void_p])
        self.ucp_ep_rkey_unpack = self._fn(
            ucp, "ucp_ep_rkey_unpack", ucs_status_t, [ucp_ep_h, c_void_p, p(ucp_rkey_h)]
        )
        self.ucp_rkey_destroy = self._fn(ucp, "ucp_rkey_destroy", None, [ucp_rkey_h])
        self.ucp_put_nbx = self._fn(
            ucp,
            "ucp_put_nbx",
            ucs_status_ptr_t,
            [ucp_ep_h, c_void_p, c_size_t, c_uint64, ucp_rkey_h, p(ucp_request_param_t)],
        )
        self.ucp_request_check_status = self._fn(
            ucp, "ucp_request_check_status", ucs_status_t, [c_void_p]
        )
        self.ucp_request_cancel = self._fn(
            ucp, "ucp_request_cancel", None, [ucp_worker_h, c_void_p]
        )
        self.ucp_request_free = self._fn(ucp, "ucp_request_free", None, [c_void_p])
        self.ucs_status_string = self._fn(ucs, "ucs_status_string", c_char_p, [ucs_status_t])

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:  # a build older than this binding supports
            raise OSError(f"{lib._name} has no {name}") from exc
        fn.restype = restype
        fn.argtypes = argtypes
        return fn

    def version(self) -> tuple[int, int, int]:
        """The (major, minor, release) of the loaded libucp."""
        major, minor, release = c_uint(), c_uint(), c_uint()
        self.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        return major.value, minor.value, release.value

    def version_text(self) -> str:
        """`1.13.1`."""
        return ".".join(map(str, self.version()))

    def api_version(self) -> tuple[int, int]:
        """The UCP API version to pass to `ucp_init_version`: the loaded library's, at most
        the binding's (a newer number only makes UCX warn that the library is older)."""
        major, minor, _ = self.version()
        return major, min(minor, UCP_API_MINOR)

    def describe(self) -> str:
        """`UCX 1.13.1 from library=system (/usr/lib/.../libucp.so.0.0.0)`, for messages."""
        return f"UCX {self.version_text()} from {self.build.label()}"

    def resources(self) -> list[_uct.Resource]:
        """The build's transport resources, listed through its libuct once per process."""
        if self._resources is None:
            self._resources = _uct.list_resources(self._uct)[1]
        return self._resources

    def config_values(self, config: c_void_p) -> dict[str, str]:
        """Every UCP value of a `ucp_config_t` as UCX will use it (the environment, UCX's
        config files and `ucp_config_modify` applied), by name without `UCX_`, and the
        transport options given through `ucp_config_modify`: what `ucp_config_print` writes,
        read back through an `open_memstream` buffer. (Transport options set only in the
        environment are not in it: the transports read those themselves.)"""
        text = self._print(config)
        values: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and not key.startswith("#"):
                # UCP's own variables print with the prefix; transport options given through
                # ucp_config_modify (kept for the transports, e.g. IB_GID_INDEX) without it.
                values[key.removeprefix("UCX_")] = value
        return values

    def transport_options(self, config: c_void_p) -> dict[str, str]:
        """The transport options given to a `ucp_config_t` through `ucp_config_modify` (UCP
        keeps them for the transports; `ucp_config_print` prints them without `UCX_`)."""
        out: dict[str, str] = {}
        for line in self._print(config).splitlines():
            key, sep, value = line.partition("=")
            if sep and not key.startswith(("UCX_", "#")):
                out[key] = value
        return out

    def _print(self, config: c_void_p) -> str:
        """What `ucp_config_print` writes for `config` (its `UCS_CONFIG_PRINT_CONFIG` lines)."""
        libc = ctypes.CDLL(None)
        libc.open_memstream.restype = c_void_p
        libc.open_memstream.argtypes = [POINTER(c_void_p), POINTER(c_size_t)]
        libc.fclose.argtypes = [c_void_p]
        libc.free.argtypes = [c_void_p]
        buf, size = c_void_p(), c_size_t()
        stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not stream:
            raise OSError(ctypes.get_errno(), "open_memstream failed")
        try:
            self.ucp_config_print(config, stream, None, UCS_CONFIG_PRINT_CONFIG)
        finally:
            libc.fclose(stream)
        try:
            text = ctypes.string_at(buf, size.value).decode(errors="replace")
        finally:
            libc.free(buf)
        return text

    def status_string(self, status: int) -> str:
        """UCX's text for a status code."""
        text = self.ucs_status_string(status)
        return text.decode() if text else f"status {status}"


class UcxBuildConflictError(ConfigurationError):
    """This process already loaded another UCX build (one build per process)."""


_LOAD_LOCK = threading.Lock()
_loaded: LibUcp | None = None


def loaded() -> LibUcp | None:
    """The build this process loaded through `load`, if any."""
    return _loaded


def load(build: UcxBuild) -> LibUcp:
    """Load libucp from `build` (once per process; the same build again returns it).

    Raises:
        UcxBuildConflictError: this process already loaded another build (one line naming both).
        ConfigurationError: the build is older than `MIN_VERSION`.
        OSError: the shared libraries cannot be loaded.
    """
    global _loaded
    with _LOAD_LOCK:
        if _loaded is None:
            if build.has_efa_module:
                from weight_transfer.backends.ucx_native._builds import keep_efa_module_out

                keep_efa_module_out()  # before its libucs reads UCX_MODULES
            # Recorded before any check: once its files are in the process, it is the build.
            _loaded = LibUcp(build, _uct.open_build(build.files))
        elif _loaded.build.libucp != build.libucp:
            raise UcxBuildConflictError(
                f"ucx: {build.label()} refused: this process already loaded "
                f"{_loaded.describe()}, and a process holds one UCX build (two copies of UCX "
                "install their memory hooks and global state over each other); give every ucx "
                "transport of a process the same `library`"
            )
        lib = _loaded
    if lib.version()[:2] < MIN_VERSION:
        raise ConfigurationError(
            f"ucx: {lib.describe()} is older than UCX {'.'.join(map(str, MIN_VERSION))}, "
            "the oldest this binding supports"
        )
    return lib
