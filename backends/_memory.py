"""Raw-address helpers shared by the backends: views, copies, shm, cutting byte runs.

Everything here works on plain integer addresses of host memory. Callers own the memory and
must keep it alive while a view or copy uses it; nothing here checks that.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import threading
from collections.abc import Sequence

__all__ = [
    "ShmMapping",
    "cut_at",
    "host_identity",
    "host_view",
    "memmove",
    "shm_file_of",
]

_SHM_DIR = "/dev/shm"


def cut_at(lengths: Sequence[int], bounds: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """Cut a byte sequence made of pieces of `lengths` (in order) at the offsets `bounds`.

    `bounds` increase and the last is at least the total. Share k gets the bytes in
    [bounds[k-1], bounds[k]) as `(piece index, offset in the piece, bytes)`, in order; a piece
    that straddles a bound is split there. Every byte lands in exactly one share; a share with
    no bytes is empty.
    """
    shares: list[list[tuple[int, int, int]]] = [[] for _ in bounds]
    k = 0
    at = 0  # bytes before the current piece
    for i, n in enumerate(lengths):
        done = 0
        while done < n:
            while at + done >= bounds[k]:
                k += 1
            take = min(n - done, bounds[k] - at - done)
            shares[k].append((i, done, take))
            done += take
        at += n
    return shares


def host_view(address: int, nbytes: int) -> memoryview:
    """A writable, byte-format memoryview over `nbytes` of host memory at `address`.

    The view does not keep the memory alive; the caller must.
    """
    if address <= 0 or nbytes <= 0:
        raise ValueError(f"host_view needs a positive address and size, got {address}, {nbytes}")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def memmove(dst_address: int, src_address: int, nbytes: int) -> None:
    """Copy `nbytes` between host addresses (overlap allowed). Releases the GIL while copying."""
    ctypes.memmove(dst_address, src_address, nbytes)


_host_identity_lock = threading.Lock()
_host_identity: str | None = None


def host_identity() -> str:
    """A string that differs between hosts and between boots: `<hostname>/<boot id>`."""
    global _host_identity
    with _host_identity_lock:
        if _host_identity is None:
            try:
                with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                    boot_id = f.read().strip()
            except OSError:
                boot_id = "no-boot-id"
            _host_identity = f"{socket.gethostname()}/{boot_id}"
        return _host_identity


def shm_file_of(address: int) -> tuple[str, int] | None:
    """Find the /dev/shm file mapped at `address` in this process.

    Returns:
        (segment name without the /dev/shm prefix, byte offset of `address` in that file), or
        None if `address` is not inside a shared-memory file mapping.
    """
    prefix = _SHM_DIR + "/"
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            if not path.startswith(prefix):
                continue
            lo_s, hi_s = parts[0].split("-")
            lo, hi = int(lo_s, 16), int(hi_s, 16)
            if lo <= address < hi:
                return path[len(prefix) :], int(parts[2], 16) + (address - lo)
    return None


class ShmMapping:
    """A read-write mapping of a whole /dev/shm segment, opened by name.

    Not thread-safe; `close` must not run while a copy into the mapping is in progress.
    """

    def __init__(self, name: str) -> None:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"invalid shared-memory segment name {name!r}")
        self.name = name
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
        try:
            self.nbytes = os.fstat(fd).st_size
            if self.nbytes <= 0:
                raise ValueError(f"shared-memory segment {name!r} is empty")
            self._map: mmap.mmap | None = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        # Exporting a buffer pins the mmap until this ctypes object is dropped (see close()).
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)

    def close(self) -> None:
        """Unmap. Idempotent."""
        self._anchor = None
        if self._map is not None:
            self._map.close()
            self._map = None
