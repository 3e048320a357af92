"""Why is a cross-process CUDA IPC write slow, and which copy reaches the NVLink rate?

Run on a machine with 2 GPUs: `python benchmarks/probes/gpu_ipc_probe.py --json out.json`.
A receiver process owns a buffer on GPU1 and exports a CUDA IPC handle; a sender process (GPU0)
opens it and writes 256 MiB with each candidate method, verifying the bytes after each, and the
in-process peer copy GPU0->GPU1 is measured in the same run as the ceiling.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

SIZE = 256 << 20


def receiver(conn, size: int) -> None:
    torch.cuda.set_device(1)
    buf = torch.empty(size, dtype=torch.uint8, device="cuda:1")
    buf.fill_(7)
    torch.cuda.synchronize()
    fields = buf.untyped_storage()._share_cuda_()
    conn.send([f if not isinstance(f, bytes) else bytes(f) for f in fields])
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        # Checksum request: sum of bytes as int64 and the first/last bytes
        torch.cuda.synchronize()
        conn.send((int(buf.to(torch.int64).sum().item()), int(buf[0].item()), int(buf[-1].item())))


def timeit(fn, sync, reps=10, warm=3) -> list[float]:
    for _ in range(warm):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def sender(conn, size: int, res) -> None:
    import cupy

    torch.cuda.set_device(0)
    fields = conn.recv()
    results: dict[str, Any] = {}
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
    expect = int(src.to(torch.int64).sum().item())

    def check(name):
        conn.send("check")
        s, first, last = conn.recv()
        ok = s == expect and first == int(src[0].item()) and last == int(src[-1].item())
        results.setdefault(name, {})["verified"] = ok

    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    dst1 = torch.empty(0, dtype=torch.uint8, device="cuda:1").set_(storage, 0, (size,), (1,))
    ptr = dst1.data_ptr()

    def sync_all() -> None:
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    def record(name, ts):
        med = statistics.median(ts)
        results.setdefault(name, {}).update(
            median_s=med, gbps=size / med / 1e9, runs=[round(t * 1e3, 3) for t in ts]
        )
        print(f"{name:40s} {size / med / 1e9:8.1f} GB/s", flush=True)

    # A. naive torch copy_ into the IPC-opened tensor (device 1 in this process)
    record("A torch copy_ to ipc tensor", timeit(lambda: dst1.copy_(src), sync_all))
    check("A torch copy_ to ipc tensor")
    peer = torch.cuda.can_device_access_peer(0, 1)
    results["can_access_peer_0_1"] = peer
    # B. cudaMemcpyAsync (UVA, default kind) on a device-0 stream, peer access enabled
    with cupy.cuda.Device(0):
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(1)
            results["enable_peer"] = "ok"
        except Exception as exc:  # already enabled by torch
            results["enable_peer"] = str(exc)
        stream = cupy.cuda.Stream(non_blocking=True)

        def b():
            cupy.cuda.runtime.memcpyAsync(ptr, src.data_ptr(), size, 4, stream.ptr)

        record("B cudaMemcpyAsync default (dev0 stream)", timeit(b, stream.synchronize))
        check("B cudaMemcpyAsync default (dev0 stream)")

        def c():
            cupy.cuda.runtime.memcpyPeerAsync(ptr, 1, src.data_ptr(), 0, size, stream.ptr)

        record("C cudaMemcpyPeerAsync", timeit(c, stream.synchronize))
        check("C cudaMemcpyPeerAsync")
        # D. SM copy kernel on device 0 writing through the mapping
        mem = cupy.cuda.UnownedMemory(ptr, size, None, device_id=0)
        dst_cp = cupy.ndarray(
            (size // 16,), dtype=cupy.complex128, memptr=cupy.cuda.MemoryPointer(mem, 0)
        )
        smem = cupy.cuda.UnownedMemory(src.data_ptr(), size, None, device_id=0)
        src_cp = cupy.ndarray(
            (size // 16,), dtype=cupy.complex128, memptr=cupy.cuda.MemoryPointer(smem, 0)
        )

        def d():
            with stream:
                cupy.copyto(dst_cp, src_cp)

        try:
            record("D cupy copy kernel on dev0", timeit(d, stream.synchronize))
            check("D cupy copy kernel on dev0")
        except Exception as exc:
            results["D cupy copy kernel on dev0"] = {"error": str(exc)}
        # E. chunked memcpyAsync over 4 streams
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]

        def e():
            n = size // 4
            for i, s in enumerate(streams):
                cupy.cuda.runtime.memcpyAsync(ptr + i * n, src.data_ptr() + i * n, n, 4, s.ptr)

        record("E memcpyAsync 4 streams", timeit(e, lambda: [s.synchronize() for s in streams]))
        check("E memcpyAsync 4 streams")
    # H/I. open the legacy IPC handle in the SENDER's context (device 0, lazy peer access), as
    # UCX's cuda_ipc does, then copy with the copy engine (H) or an SM kernel (I).
    with cupy.cuda.Device(0):
        handle = fields[1][2:] if len(fields[1]) == 66 else fields[1]
        base = cupy.cuda.runtime.ipcOpenMemHandle(handle, 1)
        ptr0 = base + int(fields[3])
        s2 = cupy.cuda.Stream(non_blocking=True)

        def h():
            cupy.cuda.runtime.memcpyAsync(ptr0, src.data_ptr(), size, 4, s2.ptr)

        record("H ipc opened on dev0 + memcpyAsync", timeit(h, s2.synchronize))
        check("H ipc opened on dev0 + memcpyAsync")
        mem0 = cupy.cuda.UnownedMemory(ptr0, size, None, device_id=0)
        dst0 = cupy.ndarray(
            (size // 16,), dtype=cupy.complex128, memptr=cupy.cuda.MemoryPointer(mem0, 0)
        )

        def i():
            with s2:
                cupy.copyto(dst0, src_cp)

        record("I ipc opened on dev0 + copy kernel", timeit(i, s2.synchronize))
        check("I ipc opened on dev0 + copy kernel")
        for mib in (1, 16, 64):
            n = mib << 20

            def hs(n=n):
                cupy.cuda.runtime.memcpyAsync(ptr0, src.data_ptr(), n, 4, s2.ptr)

            ts = timeit(hs, s2.synchronize, reps=20)
            results[f"H size {mib} MiB"] = {"gbps": n / statistics.median(ts) / 1e9}
            print(f"H size {mib} MiB: {n / statistics.median(ts) / 1e9:.1f} GB/s", flush=True)
    # F. torch copy_ after peer access enabled (A again)
    record("F torch copy_ again (peer enabled)", timeit(lambda: dst1.copy_(src), sync_all))
    # G. torch copy_ into a device-0 alias of the remote pointer
    torch.cuda.set_device(0)
    with torch.cuda.stream(torch.cuda.Stream(0)):
        s0 = torch.cuda.current_stream(0)
        record(
            "G torch copy_ on dev0 stream into dst1",
            timeit(lambda: dst1.copy_(src, non_blocking=True), s0.synchronize),
        )
    # Ceiling: in-process peer copy
    a = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
    bb = torch.empty(size, dtype=torch.uint8, device="cuda:1")
    record("ceiling in-process peer copy", timeit(lambda: bb.copy_(a), sync_all))
    conn.send("stop")
    res.put(results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="gpu_ipc_probe.json")
    ap.add_argument("--size-mib", type=int, default=256)
    ns = ap.parse_args()
    size = ns.size_mib << 20
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res = ctx.Queue()
    pr = ctx.Process(target=receiver, args=(a, size))
    ps = ctx.Process(target=sender, args=(b, size, res))
    pr.start()
    ps.start()
    out = res.get(timeout=300)
    ps.join(60)
    pr.join(60)
    out["exit_codes"] = [pr.exitcode, ps.exitcode]
    with open(ns.json, "w") as f:
        json.dump(out, f, indent=1)
    print(
        json.dumps(
            {
                k: (v.get("gbps"), v.get("verified")) if isinstance(v, dict) else v
                for k, v in out.items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
