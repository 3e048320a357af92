"""Count + encode of a delta in one pass over the data: tiles chained by decoupled look-back.

The library reads the new bytes and the snapshot once to count changes per chunk (and write a
bitmap), synchronizes, then encodes from the bitmap (a gather of the changed elements): the
count runs at about 1.15x the memory bound and the encode, latency-bound at low densities,
adds 0.8-1.1 ms per 4 GiB on an H200. Here one launch reads each tile of `TILE` elements once,
counts its changes, publishes the count in a flag word, learns the number of changes of every
earlier tile of the launch from its predecessors' flags (decoupled look-back: an aggregate, or
an inclusive prefix that ends the walk), publishes its own inclusive prefix, and writes its
changed elements (16-bit index in their chunk, value) at their final place in one scratch
array for the launch, in index order, run after run: exactly the entries the library's
`count_runs` + `encode_runs` give, concatenated. Per-chunk counts are added atomically, so the
host still learns every run's chunk offsets with one synchronization. Tiles take their order
from the grid (`--order pid`, relying on the GPU starting programs in grid order, as
predecessors must run first) or from an atomic ticket (`--order ticket`, no such reliance).

Every output is compared with the library's `count_runs` + `encode_runs` of the same runs
(cleared before the timed calls and compared after); wall time of whole calls, min / median /
max of `--repeats`, beside a device copy of the same bytes measured in the same run.

    python benchmarks/probes/gpu_delta_onepass_probe.py --gib 4 --densities 0.0078 0.054 \
        --json out.json
    TRITON_INTERPRET=1 python benchmarks/probes/gpu_delta_onepass_probe.py --check  # CPU
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from weight_transfer.benchmarks.probes.gpu_delta_kernel_probe import _split, _wall
from weight_transfer.kernels import delta as lib
from weight_transfer.kernels._delta_triton_jit import _find_run
from weight_transfer.kernels.delta import count_runs, encode_runs, int_view, num_chunks

_SHIFT = 40
"""Flag word: status << 40 | count (1: the tile's own count; 2: inclusive prefix)."""


@triton.jit
def onepass_kernel(
    runs_ptr,
    first_ptr,
    num_runs,
    flags_ptr,
    ticket_ptr,
    counts_ptr,
    index_ptr,
    values_ptr,
    cap,
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    LOG: tl.constexpr,
    TICKET: tl.constexpr,
    W: tl.constexpr,
    ABLATE: tl.constexpr = 0,
):
    """Run [new, old, numel, row0, aligned]: tile `local` of the run (TILE divides CHUNK)
    compares TILE elements, adds its changes to counts[row0 + local * TILE // CHUNK] and
    writes them at index/values[prefix ...] (prefix: changes of all earlier tiles of the
    launch; entries at cap or beyond are dropped, the caller checks the total)."""
    if TICKET:
        t = tl.atomic_add(ticket_ptr, 1).to(tl.int64)
    else:
        t = tl.program_id(0).to(tl.int64)
    run = _find_run(first_ptr, num_runs, t, LOG)
    local = t - tl.load(first_ptr + run)
    r = runs_ptr + run * 5
    start = local * TILE
    new = tl.load(r).to(tl.pointer_type(DTYPE)) + start
    old = tl.load(r + 1).to(tl.pointer_type(DTYPE)) + start
    rem = tl.load(r + 2) - start
    g = tl.load(r + 3) + start // CHUNK
    lane = tl.arange(0, TILE)
    if (tl.load(r + 4) != 0) & (rem >= TILE):
        a = tl.load(tl.multiple_of(new, 16) + lane)
        b = tl.load(tl.multiple_of(old, 16) + lane)
        ne = (a != b).to(tl.int32)
    else:
        m = lane < rem
        a = tl.load(new + lane, mask=m, other=0)
        b = tl.load(old + lane, mask=m, other=0)
        ne = ((a != b) & m).to(tl.int32)
    cnt = tl.sum(ne, axis=0).to(tl.int64)
    one: tl.constexpr = 1 << 40
    mask: tl.constexpr = (1 << 40) - 1
    prefix = cnt * 0
    if ABLATE == 1:  # timing only: no look-back (every tile writes at 0)
        prefix = cnt * 0
    elif t == 0:
        tl.atomic_xchg(flags_ptr, 2 * one + cnt, sem="relaxed")
    else:
        tl.atomic_xchg(flags_ptr + t, one + cnt, sem="relaxed")
        # Look back a window of W flags at a time (ending at j): the nearest inclusive prefix
        # in it plus the aggregates after it; all aggregates and one window further back when
        # none is inclusive; read the window again while any flag after the nearest inclusive
        # is unpublished. Flags before tile 0 read as inclusive prefixes of 0.
        win = tl.arange(0, W)
        j = t - 1
        done = cnt * 0
        while done == 0:
            at = j - (W - 1) + win
            f = tl.load(flags_ptr + at, mask=at >= 0, other=2 * one, volatile=True)
            st = f >> 40
            k = tl.max(tl.where(st == 2, win, -1), axis=0)
            pending = tl.sum(((win > k) & (st == 0)).to(tl.int32), axis=0)
            ready = pending == 0
            add = tl.sum(tl.where(win >= k, f & mask, 0), axis=0)
            prefix += tl.where(ready, add, 0)
            done = (ready & (k >= 0)).to(tl.int64)
            j = tl.where(ready, j - W, j)
        tl.atomic_xchg(flags_ptr + t, 2 * one + prefix + cnt, sem="relaxed")
    tl.atomic_add(counts_ptr + g, cnt, sem="relaxed")
    pos = prefix + (tl.cumsum(ne, axis=0) - ne).to(tl.int64)
    keep = (ne != 0) & (pos < cap)
    if ABLATE != 2:  # timing only (2): no entries written
        tl.store(index_ptr + pos, ((start % CHUNK) + lane).to(tl.int16), mask=keep)
        tl.store(values_ptr + pos, a, mask=keep)


class OnePass:
    """One launch's table, flags and scratch for runs of `a` against `b` (flat int views)."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        runs: list[tuple[int, int]],
        cap: int,
        tile: int,
        warps: int,
        ticket: bool,
        window: int = 32,
        ablate: int = 0,
    ) -> None:
        dev = a.device
        esz = a.element_size()
        self.runs, self.tile, self.warps, self.ticket = runs, tile, warps, ticket
        self.window, self.ablate = window, ablate
        numel = np.array([s for _, s in runs], np.int64)
        chunks = (numel + lib.CHUNK_ELEMENTS - 1) // lib.CHUNK_ELEMENTS
        row0 = np.zeros(len(runs), np.int64)
        np.cumsum(chunks[:-1], out=row0[1:])
        newp = np.array([a.data_ptr() + o * esz for o, _ in runs], np.int64)
        oldp = np.array([b.data_ptr() + o * esz for o, _ in runs], np.int64)
        aligned = ((newp % 16 == 0) & (oldp % 16 == 0)).astype(np.int64)
        table = np.stack([newp, oldp, numel, row0, aligned], axis=1)
        tiles = (numel + tile - 1) // tile
        first = np.zeros(len(runs) + 1, np.int64)
        np.cumsum(tiles, out=first[1:])
        self.tiles = int(first[-1])
        self.log = max(1, len(runs).bit_length())
        host = torch.from_numpy(np.concatenate([table.reshape(-1), first]))
        on = host.to(dev)
        self.table, self.first = on[: table.size], on[table.size :]
        self.rows = int(chunks.sum())
        self.chunks = chunks
        # flags, ticket and counts zeroed by one memset per call
        self.state = torch.zeros(self.tiles + 1 + self.rows, dtype=torch.int64, device=dev)
        self.index = torch.empty(cap, dtype=torch.int16, device=dev)
        self.values = torch.empty(cap, dtype=a.dtype, device=dev)
        self.cap = cap
        self.dtype = {1: tl.int8, 2: tl.int16, 4: tl.int32}[esz]
        self.counts_host = torch.empty(self.rows, dtype=torch.int64, pin_memory=a.is_cuda)

    def __call__(self) -> np.ndarray:
        self.state.zero_()
        flags = self.state[: self.tiles]
        ticket = self.state[self.tiles : self.tiles + 1]
        counts = self.state[self.tiles + 1 :]
        onepass_kernel[(self.tiles,)](
            self.table,
            self.first,
            len(self.runs),
            flags,
            ticket,
            counts,
            self.index,
            self.values,
            self.cap,
            DTYPE=self.dtype,
            CHUNK=lib.CHUNK_ELEMENTS,
            TILE=self.tile,
            LOG=self.log,
            TICKET=self.ticket,
            W=self.window,
            ABLATE=self.ablate,
            num_warps=self.warps,
        )
        self.counts_host.copy_(counts, non_blocking=True)
        if counts.is_cuda:
            torch.cuda.current_stream().synchronize()
        return self.counts_host.numpy()


def _library(a: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]]) -> Any:
    news = [a[o : o + k] for o, k in runs]
    olds = [b[o : o + k] for o, k in runs]
    counted = count_runs(news, olds)
    bufs = [
        (
            i,
            torch.empty(num_chunks(k) + 1, dtype=torch.int64, device=a.device),
            torch.empty(t, dtype=torch.int16, device=a.device),
            torch.empty(t, dtype=a.dtype, device=a.device),
        )
        for i, ((_, k), t) in enumerate(zip(runs, counted.totals, strict=True))
    ]

    def call() -> None:
        encode_runs(count_runs(news, olds), bufs, olds)

    return call, bufs


def _equal(op: OnePass, counts: np.ndarray, bufs: list[Any]) -> bool:
    """The one-pass scratch and counts against the library's per-run chunk lists."""
    at, row = 0, 0
    for (_, offsets, index, values), c in zip(bufs, op.chunks.tolist(), strict=True):
        mine = np.zeros(c + 1, np.int64)
        np.cumsum(counts[row : row + c], out=mine[1:])
        tot = int(mine[-1])
        if not np.array_equal(mine, offsets.cpu().numpy()):
            return False
        if at + tot > op.cap:
            return False
        if not (
            torch.equal(op.index[at : at + tot], index)
            and torch.equal(op.values[at : at + tot], values)
        ):
            return False
        at, row = at + tot, row + c
    return True


def _stats(ts: list[float], copy: float) -> dict[str, float]:
    med = statistics.median(ts)
    return {"min_s": min(ts), "median_s": med, "max_s": max(ts), "vs_copy": med / copy}


def _check() -> int:
    """Small runs of odd sizes and three element sizes under triton's interpreter (or a GPU):
    equal to the library's count + encode."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(3)
    ok = True
    for dtype, esz in ((torch.int16, 2), (torch.int8, 1), (torch.int32, 4)):
        n = 3 * lib.CHUNK_ELEMENTS + 777
        old = torch.randint(-100, 100, (n,), generator=gen).to(dtype)
        new = old.clone()
        hit = torch.rand(n, generator=gen) < 0.03
        new[hit] += 1
        new[:5000] += 1  # a dense stretch
        old, new = old.to(dev), new.to(dev)
        runs = [
            (0, 5),
            (5, lib.CHUNK_ELEMENTS + 3),
            (lib.CHUNK_ELEMENTS + 8, 2 * lib.CHUNK_ELEMENTS),
            (3 * lib.CHUNK_ELEMENTS + 8, 769),
        ]
        for tile, ticket in ((1024, False), (2048, True)):
            op = OnePass(new, old, runs, cap=n, tile=tile, warps=4, ticket=ticket)
            counts = op()
            call, bufs = _library(new, old, runs)
            call()
            good = _equal(op, counts, bufs)
            print(f"check esize={esz} tile={tile} ticket={ticket}: {'ok' if good else 'DIFFERENT'}")
            ok = ok and good
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Measure and print JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--densities", type=float, nargs="+", default=[0.0078, 0.054])
    p.add_argument("--tiles", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--orders", nargs="+", default=["pid", "ticket"])
    p.add_argument("--windows", type=int, nargs="+", default=[32], help="look-back window")
    p.add_argument(
        "--ablate",
        type=int,
        nargs="+",
        default=[0],
        help="0: the kernel; timing only, outputs not checked: 1 no look-back, 2 no entry stores",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--check", action="store_true", help="small correctness check only")
    p.add_argument("--json", default="")
    ns = p.parse_args(argv)
    if ns.check:
        return _check()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (or --check under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    n = int(ns.gib * 2**30) // 2
    old = torch.randn(n, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(old)
    t_copy = statistics.median(_wall(lambda: dst.copy_(old), ns.repeats))
    rows: list[dict[str, Any]] = []
    ok = True
    for density in ns.densities:
        new = old.clone()
        a, b = int_view(new), int_view(old)
        mask = torch.rand(n, device=dev) < density
        a[mask] ^= 1
        del mask
        cap = int(1.1 * density * n) + 65536
        for label, runs in (("1 run", [(0, n)]), ("130 runs", _split(n))):
            call, bufs = _library(a, b, runs)
            call()
            ref = [(o.clone(), i.clone(), v.clone()) for _, o, i, v in bufs]
            lib_ts = _wall(call, ns.repeats)
            lib_ok = all(
                torch.equal(o, ro) and torch.equal(i, ri) and torch.equal(v, rv)
                for (_, o, i, v), (ro, ri, rv) in zip(bufs, ref, strict=True)
            )
            row: dict[str, Any] = {
                "density": density,
                "runs": label,
                "copy_s": t_copy,
                "library": _stats(lib_ts, t_copy),
                "library_exact": lib_ok,
                "onepass": {},
            }
            for order in ns.orders:
                for tile in ns.tiles:
                    for warps, window, abl in itertools.product(ns.warps, ns.windows, ns.ablate):
                        op = OnePass(a, b, runs, cap, tile, warps, order == "ticket", window, abl)
                        op()
                        op.index.fill_(-1)
                        op.values.fill_(-1)
                        counts = [op()]
                        ts = _wall(lambda op=op, counts=counts: counts.append(op()), ns.repeats)
                        exact = abl != 0 or all(_equal(op, c, bufs) for c in counts[-2:])
                        ok = ok and exact and lib_ok
                        key = f"{order}/t{tile}/w{warps}/W{window}" + (
                            f"/ablate{abl}" if abl else ""
                        )
                        row["onepass"][key] = {**_stats(ts, t_copy), "exact": exact}
                        del op
            best = min(row["onepass"].items(), key=lambda kv: kv[1]["median_s"])
            row["best"] = best[0]
            print(
                f"{density:.4f} {label}: copy {t_copy * 1e3:.3f} ms, library "
                f"{row['library']['median_s'] * 1e3:.3f} ms ({row['library']['vs_copy']:.2f}x), "
                f"one pass best {best[0]} {best[1]['median_s'] * 1e3:.3f} ms "
                f"({best[1]['vs_copy']:.2f}x) exact={best[1]['exact']}",
                flush=True,
            )
            rows.append(row)
    out = {"gpu": torch.cuda.get_device_name(dev), "bytes": 2 * n, "rows": rows}
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
