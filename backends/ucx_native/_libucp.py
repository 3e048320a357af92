"""Typed ctypes binding of the part of libucp (UCX 1.22) that one-sided writes need.

Struct layouts and constants follow the headers shipped in the `libucx-cu13` 1.22.0 wheel
(`libucx/include/ucp/api/ucp.h`, `ucp_def.h`, `ucs/type/status.h`,
`ucs/memory/memory_type.h`). `tests/unit/test_ucx_binding.py` pins every size and field offset
to the values a C compiler reports for those headers on x86_64, so a layout drift fails a test
instead of corrupting memory. Nothing here is public API: `backends.ucx` is the only user.

The library is loaded lazily (`load()`), never at import time, through the wheel's own
`libucx.load_library()` helper so that libucp's dependencies (libucs, libuct, libucm) and its
transport modules resolve from the wheel.
"""

from __future__ import annotations

import ctypes
import functools
import os
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
from typing import Any

# -- API version this binding was written against (ucp_version.h) -------------------------------
UCP_API_MAJOR = 1
UCP_API_MINOR = 22

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

    def __init__(self, ucp: ctypes.CDLL, ucs: ctypes.CDLL, lib_dir: str) -> None:
        self.lib_dir = lib_dir
        self._ucp = ucp
        self._ucs = ucs
        p = POINTER
        self.ucp_get_version = self._fn(ucp, "ucp_get_version", None, [p(c_uint)] * 3)
        self.ucp_config_read = self._fn(
            ucp, "ucp_config_read", ucs_status_t, [c_char_p, c_char_p, p(ucp_config_p)]
        )
        self.ucp_config_modify = self._fn(
            ucp, "ucp_config_modify", ucs_status_t, [ucp_config_p, c_char_p, c_char_p]
        )
        self.ucp_config_release = self._fn(ucp, "ucp_config_release", None, [ucp_config_p])
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
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
        return fn

    def version(self) -> tuple[int, int, int]:
        """The (major, minor, release) of the loaded libucp."""
        major, minor, release = c_uint(), c_uint(), c_uint()
        self.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        return major.value, minor.value, release.value

    def status_string(self, status: int) -> str:
        """UCX's text for a status code."""
        text = self.ucs_status_string(status)
        return text.decode() if text else f"status {status}"


@functools.lru_cache(maxsize=1)
def load() -> LibUcp:
    """Load libucp from the `libucx` wheel (once per process).

    Raises:
        ImportError: the `libucx` package is not installed.
        OSError: the shared libraries cannot be loaded.
    """
    import libucx  # the wheel's helper; ImportError here means the extra is missing

    libucx.load_library()
    lib_dir = os.path.join(os.path.dirname(libucx.__file__), "lib")
    ucs = ctypes.CDLL(os.path.join(lib_dir, "libucs.so"), ctypes.RTLD_LOCAL)
    ucp = ctypes.CDLL(os.path.join(lib_dir, "libucp.so"), ctypes.RTLD_LOCAL)
    return LibUcp(ucp, ucs, lib_dir)
