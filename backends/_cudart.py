"""The few CUDA runtime calls the loopback backend needs, through ctypes on torch's libcudart.

Why not torch's own IPC path: `UntypedStorage._new_shared_cuda` opens a peer's IPC handle in the
context of the *exporting* device, and every copy into such a mapping from another device, by
copy engine or by SM kernel, ran at about 38 GB/s on a 2x H200 NVLink machine (370 GB/s for an
in-process peer copy; benchmarks/probes/gpu_ipc_probe.py measures both). Opening the handle in the
*writer's* device context with `cudaIpcMemLazyEnablePeerAccess`, as UCX's cuda_ipc transport does,
maps the peer's memory over NVLink for that device, and `cudaMemcpyAsync` on the writer's stream
then runs at the link's rate.
"""

from __future__ import annotations

import ctypes
import threading

from weight_transfer.backends.base import TransportError

_IPC_HANDLE_BYTES = 64
CUDA_MEMCPY_DEFAULT = 4
CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _find_loaded_cudart() -> str | None:
    # torch has already loaded its libcudart; use that very library (same runtime, same
    # contexts) rather than whichever one the dynamic loader would find first.
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


def lib() -> ctypes.CDLL:
    """The CUDA runtime library torch uses (loaded once)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            import torch

            torch.cuda.init()
            path = _find_loaded_cudart()
            candidates = [path] if path else []
            candidates += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
            errors = []
            for c in candidates:
                try:
                    cudart = ctypes.CDLL(c)
                    break
                except OSError as exc:
                    errors.append(f"{c}: {exc}")
            else:
                raise TransportError(f"cannot load the CUDA runtime: {'; '.join(errors)}")
            cudart.cudaIpcOpenMemHandle.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                _IpcHandle,
                ctypes.c_uint,
            ]
            cudart.cudaIpcOpenMemHandle.restype = ctypes.c_int
            cudart.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
            cudart.cudaIpcCloseMemHandle.restype = ctypes.c_int
            cudart.cudaMemcpyAsync.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            cudart.cudaMemcpyAsync.restype = ctypes.c_int
            cudart.cudaGetErrorString.argtypes = [ctypes.c_int]
            cudart.cudaGetErrorString.restype = ctypes.c_char_p
            _lib = cudart
        return _lib


def check(code: int, what: str) -> None:
    """Raise TransportError for a non-zero CUDA status."""
    if code != 0:
        msg = lib().cudaGetErrorString(code)
        raise TransportError(f"{what} failed: CUDA error {code} ({msg.decode() if msg else '?'})")


def raw_ipc_handle(handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside torch's shareable handle.

    torch (2.2+) prefixes the handle with a version byte and a type byte: b"c" for memory from
    cudaMalloc, b"e" for expandable segments, which have no legacy IPC handle.
    """
    if len(handle) == _IPC_HANDLE_BYTES:
        return handle
    if len(handle) == _IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise TransportError(
            "the target lives in PyTorch expandable segments, which legacy CUDA IPC cannot "
            "share; allocate engine weights without expandable_segments"
        )
    raise ValueError(f"unrecognised CUDA IPC handle of {len(handle)} bytes")


def ipc_open(handle: bytes) -> int:
    """Map a peer's allocation into the *current* device's context; returns the base pointer."""
    handle = raw_ipc_handle(handle)
    ptr = ctypes.c_void_p()
    h = _IpcHandle()
    ctypes.memmove(ctypes.addressof(h), handle, _IPC_HANDLE_BYTES)
    check(
        lib().cudaIpcOpenMemHandle(ctypes.byref(ptr), h, CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
        "cudaIpcOpenMemHandle",
    )
    assert ptr.value is not None
    return int(ptr.value)


def ipc_close(ptr: int) -> None:
    """Unmap what `ipc_open` mapped (current device must be the one it was opened on)."""
    check(lib().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cudaMemcpyAsync with cudaMemcpyDefault (unified addressing picks the direction)."""
    check(
        lib().cudaMemcpyAsync(
            ctypes.c_void_p(dst),
            ctypes.c_void_p(src),
            nbytes,
            CUDA_MEMCPY_DEFAULT,
            ctypes.c_void_p(stream),
        ),
        "cudaMemcpyAsync",
    )
