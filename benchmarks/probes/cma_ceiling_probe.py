"""How fast can one process write into another's host memory on this machine, by hand?

The one-sided lane UCX (and NIXL's UCX plugin) uses between two processes on one host without
xpmem/knem is `cma`: `process_vm_writev` into the target's pages. This probe measures that
syscall directly, with one and two concurrent streams (threads; ctypes releases the GIL), next to
`memmove` in one process with one and two threads, for a 64 MiB buffer. It bounds what `ucx` and
`nixl` can reach in `weight-transfer bench transports` on the same machine.

    python benchmarks/probes/cma_ceiling_probe.py [--mib 64] [--repeats 25] [--chunk-mib 4]

Linux only. Prints median GB/s per case.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import statistics
import threading
import time
from typing import Any

from weight_transfer.cli.launch import Child, Launch

_LIBC = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _buffer(nbytes: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, nbytes)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
    ctypes.memset(address, 1, nbytes)  # resident before timing
    return m, address


def _target(nbytes: int, out: Any) -> None:
    """The target process: a resident buffer; its pid and address go to the parent, then it
    waits for the parent's word to exit."""
    _m, address = _buffer(nbytes)
    import os

    out.put((os.getpid(), address))
    out.get(300)


def _median_gbps(nbytes: int, run: Any, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _parallel(streams: int, nbytes: int, one: Any) -> Any:
    share = nbytes // streams

    def run() -> None:
        threads = [threading.Thread(target=one, args=(k * share, share)) for k in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--chunk-mib", type=int, default=4, help="bytes per process_vm_writev call")
    args = ap.parse_args()
    nbytes = args.mib << 20
    chunk = args.chunk_mib << 20
    launch = Launch([Child("target", _target, (nbytes,))]).start()
    try:
        pid, remote = launch.recv("target", timeout_s=60)
        _src_map, src = _buffer(nbytes)
        _dst_map, dst = _buffer(nbytes)

        def cma(offset: int, n: int) -> None:
            # In calls of at most --chunk-mib, as UCX's cma does (CMA_SEG_SIZE, 4M here).
            end = offset + n
            while offset < end:
                step = min(chunk, end - offset)
                local, far = _IoVec(src + offset, step), _IoVec(remote + offset, step)
                got = _LIBC.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)
                if got != step:
                    raise OSError(ctypes.get_errno(), f"process_vm_writev wrote {got} of {step}")
                offset += step

        def copy(offset: int, n: int) -> None:
            ctypes.memmove(dst + offset, src + offset, n)

        for name, fn in (("process_vm_writev", cma), ("memmove (one process)", copy)):
            for streams in (1, 2):
                gbps = _median_gbps(nbytes, _parallel(streams, nbytes, fn), args.repeats)
                print(f"{name:24s} {streams} stream(s)  {args.mib} MiB  {gbps:6.2f} GB/s")
    finally:
        with contextlib.suppress(OSError):
            launch.send("target", "done")
        code = launch.close(grace_s=30)["target"]
    if code != 0:
        raise SystemExit(f"the target process exited with code {code}")


if __name__ == "__main__":
    main()
