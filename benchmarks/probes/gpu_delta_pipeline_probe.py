"""Count + encode of a delta with the encode of one piece overlapping the count of the next.

The library counts every chunk of a batch (one launch), reads the counts on the host, then
encodes (one launch): the encode, latency-bound at low densities (0.8-1.1 ms per 4 GiB on an
H200), adds to a count that already runs at 1.15x the memory bound. Here the batch's runs are
cut into `K` pieces; piece k+1 is counted on the current stream while piece k, whose counts the
host has read, is encoded on a second stream (optionally of higher priority), so only the last
piece's encode is not hidden. Same kernels as the library (`_delta_triton_jit`), tables copied
from pinned memory so no launch waits for the stream. Every output is compared with the
library's `count_runs` + `encode_runs` of the same runs (cleared before the timed calls and
compared after), wall time of whole calls (synchronization included), median of `--repeats`,
beside a device copy of the same bytes measured in the same run.

    python benchmarks/probes/gpu_delta_pipeline_probe.py --gib 4 --densities 0.0078 0.054 \
        --pieces 1 2 4 8 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import numpy as np
import torch

from weight_transfer.benchmarks.probes.gpu_delta_kernel_probe import _split, _wall
from weight_transfer.kernels import delta as lib
from weight_transfer.kernels.delta import count_runs, encode_runs, int_view, num_chunks


def _pieces(runs: list[tuple[int, int]], k: int) -> list[list[tuple[int, int]]]:
    """`runs` cut into k pieces of about equal bytes; a run larger than a piece is cut on chunk
    boundaries (each part then is a run of its own)."""
    total = sum(s for _, s in runs)
    target = -(-total // k)
    target = -(-target // lib.CHUNK_ELEMENTS) * lib.CHUNK_ELEMENTS
    out: list[list[tuple[int, int]]] = [[]]
    room = target
    for off, size in runs:
        while size > 0:
            take = min(size, room)
            if take < size:  # a run is cut only on its chunk boundaries
                take -= take % lib.CHUNK_ELEMENTS
            if take == 0:
                out.append([])
                room = target
                continue
            out[-1].append((off, take))
            off, size, room = off + take, size - take, room - take
    return [piece for piece in out if piece]


def _launch(kernel: Any, table: np.ndarray, chunks: np.ndarray, *args: Any, **meta: Any) -> Any:
    """`lib._run_launch` with the table copied from pinned memory (no wait for the stream)."""
    first = np.zeros(table.shape[0] + 1, dtype=np.int64)
    np.cumsum(chunks, out=first[1:])
    host = torch.from_numpy(np.concatenate([table.reshape(-1), first])).pin_memory()
    on = host.to("cuda", non_blocking=True)
    log = max(1, int(table.shape[0]).bit_length())
    kernel[(int(first[-1]),)](
        on[: table.size], on[table.size :], table.shape[0], *args, LOG=log, **meta
    )
    return host, on  # kept alive until the launch ran


class Piece:
    """One piece's runs, their device scratch and outputs."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]]) -> None:
        self.runs = runs
        self.a, self.b = a, b
        esz = a.element_size()
        self.new_ptr = np.array([a.data_ptr() + o * esz for o, _ in runs], np.int64)
        self.old_ptr = np.array([b.data_ptr() + o * esz for o, _ in runs], np.int64)
        self.numel = np.array([s for _, s in runs], np.int64)
        self.chunks = (self.numel + lib.CHUNK_ELEMENTS - 1) // lib.CHUNK_ELEMENTS
        self.first_row = np.zeros(len(runs) + 1, np.int64)
        np.cumsum(self.chunks, out=self.first_row[1:])
        rows = int(self.first_row[-1])
        self.counts = torch.empty(rows, dtype=torch.int64, device=a.device)
        self.host_counts = torch.empty(rows, dtype=torch.int64).pin_memory()
        self.wbits = torch.empty(rows * lib._WORDS, dtype=torch.int32, device=a.device)
        self.event = torch.cuda.Event()
        self.keep: list[Any] = []
        self.outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def count(self) -> None:
        """Launch the count on the current stream and the copy of its counts to the host."""
        aligned = (self.new_ptr % 16 == 0) & (self.old_ptr % 16 == 0)
        whole = np.where(aligned, self.numel // lib.CHUNK_ELEMENTS, 0)
        step = whole * lib.CHUNK_ELEMENTS
        size = self.a.element_size()
        for full, sel in ((True, whole > 0), (False, self.chunks > whole)):
            if not sel.any():
                continue
            if full:
                table = np.stack(
                    [self.new_ptr[sel], self.old_ptr[sel], step[sel], self.first_row[:-1][sel]], 1
                )
                n = whole[sel]
            else:
                table = np.stack(
                    [
                        self.new_ptr[sel] + step[sel] * size,
                        self.old_ptr[sel] + step[sel] * size,
                        self.numel[sel] - step[sel],
                        self.first_row[:-1][sel] + whole[sel],
                    ],
                    1,
                )
                n = self.chunks[sel] - whole[sel]
            self.keep.append(
                _launch(
                    lib._jit().count_runs_kernel,
                    table,
                    n,
                    self.counts,
                    self.wbits,
                    num_warps=lib._COUNT_WARPS,
                    DTYPE=lib._tl_dtype(size),
                    FULL=full,
                    CHUNK=lib.CHUNK_ELEMENTS,
                    TILE=lib._COUNT_TILE,
                )
            )
        self.host_counts.copy_(self.counts, non_blocking=True)
        self.event.record()

    def encode(self, stream: torch.cuda.Stream) -> None:
        """Wait for the counts on the host, size the outputs, launch the encode on `stream`."""
        self.event.synchronize()
        counts = self.host_counts.numpy()
        inclusive = np.zeros(counts.size + 1, np.int64)
        np.cumsum(counts, out=inclusive[1:])
        totals = inclusive[self.first_row[1:]] - inclusive[self.first_row[:-1]]
        if not self.outputs:  # allocated once, outside the timed calls' steady state
            dev = self.a.device
            self.outputs = [
                (
                    torch.empty(int(c) + 1, dtype=torch.int64, device=dev),
                    torch.empty(max(int(t), 1), dtype=torch.int16, device=dev),
                    torch.empty(max(int(t), 1), dtype=self.a.dtype, device=dev),
                )
                for c, t in zip(self.chunks, totals, strict=True)
            ]
        stream.wait_event(self.event)
        with torch.cuda.stream(stream):
            excl = torch.cumsum(self.counts, 0) - self.counts
            zeros = np.zeros(len(self.runs), np.int64)
            table = np.stack(
                [
                    self.new_ptr,
                    np.array([x.data_ptr() for _, x, _ in self.outputs], np.int64),
                    np.array([v.data_ptr() for _, _, v in self.outputs], np.int64),
                    np.array([o.data_ptr() for o, _, _ in self.outputs], np.int64),
                    self.first_row[:-1],
                    zeros,
                    zeros,
                    zeros,
                ],
                1,
            )
            self.keep.append(excl)
            self.keep.append(
                _launch(
                    lib._jit().encode_runs_kernel,
                    table,
                    self.chunks,
                    self.counts,
                    excl,
                    self.wbits,
                    num_warps=lib._ENCODE_WARPS,
                    DTYPE=lib._tl_dtype(self.a.element_size()),
                    CHUNK=lib.CHUNK_ELEMENTS,
                    BLOCK=lib._ENCODE_BLOCK,
                )
            )


def pipelined(pieces: list[Piece], stream: torch.cuda.Stream) -> None:
    """Count piece k+1 while piece k is encoded."""
    for p in pieces:
        p.keep.clear()
    pieces[0].count()
    for k, p in enumerate(pieces):
        if k + 1 < len(pieces):
            pieces[k + 1].count()
        p.encode(stream)
    torch.cuda.current_stream().wait_stream(stream)


def _reference(a: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]]) -> list[Any]:
    """The library's count_runs + encode_runs of each run: (offsets, index, values)."""
    news = [a[o : o + s] for o, s in runs]
    olds = [b[o : o + s] for o, s in runs]
    counted = count_runs(news, olds)
    bufs = [
        (
            i,
            torch.empty(num_chunks(s) + 1, dtype=torch.int64, device=a.device),
            torch.empty(max(int(t), 1), dtype=torch.int16, device=a.device),
            torch.empty(max(int(t), 1), dtype=a.dtype, device=a.device),
        )
        for i, ((_, s), t) in enumerate(zip(runs, counted.totals, strict=True))
    ]
    encode_runs(counted, bufs)
    torch.cuda.synchronize()
    totals = counted.totals
    return [(o, x[: int(t)], v[: int(t)]) for (_, o, x, v), t in zip(bufs, totals, strict=True)]


def _same(pieces: list[Piece], ref: list[Any], runs: list[tuple[int, int]]) -> bool:
    """Each piece's lists equal the library's for the same elements (a run cut into parts:
    its offsets re-based and its entries sliced)."""
    starts = {o: i for i, (o, _) in enumerate(runs)}
    ok = True
    for p in pieces:
        for (off, size), (po, px, pv) in zip(p.runs, p.outputs, strict=True):
            i = max(k for o, k in starts.items() if o <= off)
            o0, x0, v0 = ref[i]
            c0 = (off - runs[i][0]) // lib.CHUNK_ELEMENTS
            c1 = c0 + num_chunks(size)
            offs = o0[c0 : c1 + 1] - o0[c0]
            lo, hi = int(o0[c0]), int(o0[c1])
            ok &= bool(torch.equal(po, offs))
            ok &= bool(torch.equal(px[: hi - lo], x0[lo:hi]))
            ok &= bool(torch.equal(pv[: hi - lo], v0[lo:hi]))
    return ok


def main(argv: list[str] | None = None) -> int:
    """Measure and print JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.0078, 0.054])
    ap.add_argument("--pieces", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default="")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    n = int(ns.gib * 2**30) // 2
    old = torch.randn(n, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(old)
    t_copy = _wall(lambda: dst.copy_(old), ns.repeats)
    rows, exact_all = [], True
    high = torch.cuda.Stream(priority=-1)
    same = torch.cuda.Stream(priority=0)
    for density in ns.densities:
        new = old.clone()
        a, b = int_view(new), int_view(old)
        mask = torch.rand(n, device=dev) < density
        a[mask] ^= 1
        del mask
        for whole in (True, False):
            runs = [(0, n)] if whole else _split(n)
            ref = _reference(a, b, runs)
            news = [a[o : o + s] for o, s in runs]
            olds = [b[o : o + s] for o, s in runs]
            bufs = [(i, o.clone(), x.clone(), v.clone()) for i, (o, x, v) in enumerate(ref)]

            def library(news: Any = news, olds: Any = olds, bufs: Any = bufs) -> None:
                encode_runs(count_runs(news, olds), bufs)

            row: dict[str, Any] = {
                "density": density,
                "runs": len(runs),
                "copy_s": t_copy,
                "library_s": _wall(library, ns.repeats),
            }
            for k in ns.pieces:
                for name, stream in (("high", high), ("same", same)):
                    pieces = [Piece(a, b, r) for r in _pieces(runs, k)]
                    pipelined(pieces, stream)  # warm-up, allocates the outputs
                    torch.cuda.synchronize()
                    for p in pieces:
                        for out in p.outputs:
                            for t in out:
                                t.fill_(-1)
                    ts = _wall(
                        lambda pieces=pieces, stream=stream: pipelined(pieces, stream), ns.repeats
                    )
                    ok = _same(pieces, ref, runs)
                    exact_all &= ok
                    row[f"k{k}_{name}_s"] = ts
                    row[f"k{k}_{name}_exact"] = ok
            med_copy = statistics.median(t_copy)
            summary = {
                key[:-2]: round(statistics.median(v) / med_copy, 3)
                for key, v in row.items()
                if key.endswith("_s") and key != "copy_s"
            }
            row["vs_copy"] = summary
            rows.append(row)
            print(
                f"density {density} runs {len(runs)}: "
                f"copy {statistics.median(t_copy) * 1e3:.3f} ms; "
                + ", ".join(f"{k} {v}x" for k, v in summary.items()),
                flush=True,
            )
    result = {
        "gpu": torch.cuda.get_device_name(dev),
        "bytes": 2 * n,
        "rows": rows,
        "exact": exact_all,
    }
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
    print("all outputs equal to the library's:", exact_all)
    return 0 if exact_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
