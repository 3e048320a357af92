"""Bandwidth of the delta kernels on a GPU against its memory bound (H200 runs: docs/delta.md).

For a BF16 tensor of `--gib` GiB and each density: the count + encode pass (reads new and
snapshot: 2 N bytes; writes the patch) and the apply (reads the patch, scatters into N bytes),
each timed with CUDA events (median of `--repeats` after a warm-up; the table kernels by wall
time of whole calls), every round trip checked bit-exact (the table kernels' patch cleared
before timing and compared after, the timed applies' result compared too), beside a
device-to-device copy of the same N bytes measured in the same run. The memory bound of
encode is the time to read 2 N bytes at the copy's rate (a copy of N bytes moves 2 N), so
`encode_vs_bound` = t_encode / t_copy(N); apply's bound is reading and writing the patch's
entries, far below a copy; its ratio is given against t_copy(N) too.

    python benchmarks/probes/gpu_delta_kernel_probe.py --gib 4 --densities 0.005 0.02 0.08 \
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from weight_transfer.kernels.delta import (
    apply_changes,
    apply_runs,
    count_runs,
    diff_encode,
    encode_runs,
    int_view,
    num_chunks,
)

_LLAMA_RUNS = (4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 14336 * 4096, 4096)
"""Run sizes (elements) cycled to split the tensor like a Llama layer's writes."""


def _wall(fn: object, repeats: int) -> list[float]:
    """Wall seconds of whole calls (host work and synchronization included)."""
    ts = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        if i:
            ts.append(time.perf_counter() - t0)
    return ts


def _split(n: int) -> list[tuple[int, int]]:
    out, at, k = [], 0, 0
    while at < n:
        size = min(_LLAMA_RUNS[k % len(_LLAMA_RUNS)], n - at)
        out.append((at, size))
        at, k = at + size, k + 1
    return out


def _tables(
    a: torch.Tensor,
    b: torch.Tensor,
    dst: torch.Tensor,
    old: torch.Tensor,
    runs: list[tuple[int, int]],
    repeats: int,
) -> dict[str, object]:
    """count_runs + encode_runs (one sync) and apply_runs over `runs` of a/b, checked."""
    news = [a[o : o + k] for o, k in runs]
    olds = [b[o : o + k] for o, k in runs]
    counted = count_runs(news, olds)
    totals = counted.totals
    bufs = [
        (
            i,
            torch.empty(num_chunks(k) + 1, dtype=torch.int64, device=a.device),
            torch.empty(t, dtype=torch.int16, device=a.device),
            torch.empty(t, dtype=a.dtype, device=a.device),
        )
        for i, ((_, k), t) in enumerate(zip(runs, totals, strict=True))
    ]

    def encode() -> None:
        c = count_runs(news, olds)
        encode_runs(c, bufs)

    def count_only() -> None:
        count_runs(news, olds)

    encode()
    dst.copy_(old)
    d = int_view(dst)
    items = [(d[o : o + k], bufs[i][1], bufs[i][2], bufs[i][3]) for i, (o, k) in enumerate(runs)]
    apply_runs(items)
    exact = bool(torch.equal(d, a))
    # The timed calls must write the same patch again: clear it first, compare after.
    ref = [(o.clone(), i.clone(), v.clone()) for _, o, i, v in bufs]
    for _, *patch in bufs:
        for t in patch:
            t.fill_(-1)
    t_enc = _wall(encode, repeats)
    timed_exact = all(
        torch.equal(o, ro) and torch.equal(i, ri) and torch.equal(v, rv)
        for (_, o, i, v), (ro, ri, rv) in zip(bufs, ref, strict=True)
    )
    t_cnt = _wall(count_only, repeats)
    dst.copy_(old)
    t_app = _wall(lambda: apply_runs(items), repeats)
    timed_exact = timed_exact and bool(torch.equal(d, a))
    return {
        "runs": len(runs),
        "bit_exact": exact and timed_exact,
        "encode_s": t_enc,
        "count_s": t_cnt,
        "apply_s": t_app,
    }


def _time(fn: object, repeats: int) -> float:
    ts = []
    for i in range(repeats + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()  # type: ignore[operator]
        b.record()
        torch.cuda.synchronize()
        if i:
            ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    """Measure and print JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.02, 0.08])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="")
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    n = int(ns.gib * 2**30) // 2
    old = torch.randn(n, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(old)
    t_copy = _time(lambda: dst.copy_(old), ns.repeats)
    rows = []
    for density in ns.densities:
        new = old.clone()
        a, b = int_view(new), int_view(old)
        mask = torch.rand(n, device=dev) < density
        a[mask] ^= 1
        del mask
        cap = int(1.2 * density * n) + 4096
        index = torch.empty(cap, dtype=torch.int16, device=dev)
        values = torch.empty(cap, dtype=torch.int16, device=dev)
        offsets = torch.empty(num_chunks(n) + 1, dtype=torch.int64, device=dev)
        total = diff_encode(a, b, index=index, values=values, offsets=offsets)
        dst.copy_(old)
        apply_changes(int_view(dst), offsets, index, values)
        exact = bool(torch.equal(int_view(dst), a))

        def encode(
            a: torch.Tensor = a,
            b: torch.Tensor = b,
            i: torch.Tensor = index,
            v: torch.Tensor = values,
            o: torch.Tensor = offsets,
        ) -> None:
            diff_encode(a, b, index=i, values=v, offsets=o)

        def apply(
            i: torch.Tensor = index, v: torch.Tensor = values, o: torch.Tensor = offsets
        ) -> None:
            apply_changes(int_view(dst), o, i, v)

        t_enc = _time(encode, ns.repeats)
        t_app = _time(apply, ns.repeats)
        one = _tables(a, b, dst, old, [(0, n)], ns.repeats)
        many = _tables(a, b, dst, old, _split(n), ns.repeats)
        exact = exact and bool(one["bit_exact"]) and bool(many["bit_exact"])
        for t in (one, many):
            enc = statistics.median(t["encode_s"])  # type: ignore[arg-type]
            t["encode_vs_bound"] = enc / t_copy
            t["count_vs_bound"] = statistics.median(t["count_s"]) / t_copy  # type: ignore[arg-type]
            t["apply_vs_copy"] = statistics.median(t["apply_s"]) / t_copy  # type: ignore[arg-type]
        rows.append(
            {
                "density": density,
                "entries": total,
                "bit_exact": exact,
                "encode_s": t_enc,
                "apply_s": t_app,
                "copy_s": t_copy,
                "encode_vs_bound": t_enc / t_copy,
                "apply_vs_copy": t_app / t_copy,
                "encode_gb_per_s_read": 2 * 2 * n / t_enc / 1e9,
                "tables_one_run": one,
                "tables_many_runs": many,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out = {"gpu": torch.cuda.get_device_name(dev), "bytes": 2 * n, "rows": rows}
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
