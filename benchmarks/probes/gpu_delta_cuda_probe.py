"""The delta table kernels in CUDA C (`weight_transfer.kernels._delta_cuda`, through CuPy)
against the Triton ones, on a GPU, in the same run (H200 runs: docs/delta.md).

For a BF16 tensor of `--gib` GiB and each density, both kernel sets run the library's whole
calls (`count_runs` + `encode_runs`, `count_runs` alone, `apply_runs`) over one run and over
runs of Llama tensor sizes, alternating sets `--rounds` times, beside a device copy of the
same bytes measured in the same run (the bound: count + encode reads 2 N bytes, as a copy of
N bytes moves 2 N). Every round trip is checked bit-exact by
`gpu_delta_kernel_probe._tables` (the applied result against the new tensor; each timed
patch against the untimed one), and the two sets' patches are compared with each other.

    python benchmarks/probes/gpu_delta_cuda_probe.py --gib 4 --densities 0.0078 0.054 \
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from weight_transfer.benchmarks.probes.gpu_delta_kernel_probe import _split, _tables, _time
from weight_transfer.kernels import delta
from weight_transfer.kernels.delta import count_runs, encode_runs, int_view, num_chunks

_SETS = ("triton", "cuda")


def _patch(a: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The patch of `runs` (offsets, index, values per run) with the selected kernels."""
    news = [a[o : o + k] for o, k in runs]
    olds = [b[o : o + k] for o, k in runs]
    counted = count_runs(news, olds)
    outs = [
        (
            i,
            torch.full((num_chunks(k) + 1,), -1, dtype=torch.int64, device=a.device),
            torch.zeros(t, dtype=torch.int16, device=a.device),
            torch.zeros(t, dtype=a.dtype, device=a.device),
        )
        for i, ((_, k), t) in enumerate(zip(runs, counted.totals, strict=True))
    ]
    encode_runs(counted, outs)
    return [t for _, *ts in outs for t in ts]


def _sweep(a: torch.Tensor, b: torch.Tensor, repeats: int) -> dict[str, float]:
    """Device time (CUDA events, median) of the kernels alone over one whole-chunk run of
    `a`/`b` (tables built once): the CUDA C count for unroll x threads, with and without its
    bitmap stores (timing only), the Triton count, and each set's encode of that count and
    apply of that patch (the applied bytes compared with `a`)."""
    from weight_transfer.kernels import _delta_cuda as cu

    dev = a.device
    n = a.numel()
    chunks = num_chunks(n)
    counts = torch.empty(chunks, dtype=torch.int64, device=dev)
    wbits = torch.empty(chunks * 2048, dtype=torch.int32, device=dev)
    on = delta._device_table([[a.data_ptr(), b.data_ptr(), n, 0]], [chunks], dev)
    assert on is not None
    runs_t, first_t, _, _ = on
    staging = cu.Staging.new(dev, chunks, a.element_size())
    ptrs: tuple[int, ...] = (runs_t.data_ptr(), first_t.data_ptr(), counts.data_ptr())
    ptrs += (wbits.data_ptr(),)
    ptrs += staging.args()
    out: dict[str, float] = {}
    for u, threads in ((2, 512), (4, 512), (4, 256), (2, 1024), (4, 1024)):
        for store in (1, 0):
            defines = (("COUNT_UNROLL", u), ("COUNT_STORE", store), ("COUNT_BOUND", threads))

            def run(d: tuple[tuple[str, int], ...] = defines, t: int = threads) -> None:
                cu._launch(dev, "count_full_2", chunks, t, ptrs, 1, d)

            out[f"cuda_count_u{u}_t{threads}{'' if store else '_nostore'}_ms"] = (
                _time(run, repeats) * 1e3
            )
    # The library's count (u4, 512 threads) as it was before: every bitmap word stored
    # (LAZY_BITS=0) and / or the staged changes written with 2-byte stores (COUNT_VEC=0).
    for lazy, vec in ((0, 1), (1, 0), (0, 0)):
        old_way = (("LAZY_BITS", lazy), ("COUNT_VEC", vec))

        def run_old(d: tuple[tuple[str, int], ...] = old_way) -> None:
            cu._launch(dev, "count_full_2", chunks, 512, ptrs, 1, d)

        out[f"cuda_count_lazy{lazy}_vec{vec}_ms"] = _time(run_old, repeats) * 1e3
    jit = delta._jit()
    tl_int16 = delta._tl_dtype(2)

    def tri_count() -> None:
        jit.count_runs_kernel[(chunks,)](
            runs_t, first_t, 1, counts, wbits, LOG=1, num_warps=delta._COUNT_WARPS,
            DTYPE=tl_int16, FULL=True, CHUNK=delta.CHUNK_ELEMENTS, TILE=delta._COUNT_TILE,
        )  # fmt: skip

    out["triton_count_ms"] = _time(tri_count, repeats) * 1e3
    # The Triton count's whole bitmap (the encodes "from the bitmap" below read all of it; the
    # library's CUDA C count writes only the words past each chunk's staged changes), then the
    # CUDA C count's staging (its bitmap words are the same bits).
    tri_count()
    cu._launch(dev, "count_full_2", chunks, 512, ptrs, 1)
    total = int(counts.sum())
    excl = torch.cumsum(counts, 0) - counts
    offsets = torch.empty(chunks + 1, dtype=torch.int64, device=dev)
    index = torch.empty(total, dtype=torch.int16, device=dev)
    values = torch.empty(total, dtype=a.dtype, device=dev)
    row = [a.data_ptr(), index.data_ptr(), values.data_ptr(), offsets.data_ptr(), 0, 0, 0, 0]
    enc = delta._device_table([row], [chunks], dev)
    row[5] = chunks
    staged = delta._device_table([row], [chunks], dev)
    assert enc is not None and staged is not None
    enc_t = enc[0]

    def encode_with(table: torch.Tensor, d: tuple[tuple[str, int], ...] = ()) -> None:
        eptrs = (table.data_ptr(), first_t.data_ptr(), counts.data_ptr(), excl.data_ptr())
        ptrs = (*eptrs, wbits.data_ptr(), *staging.args())
        cu._launch(dev, "encode_2", chunks, 256, ptrs, 1, d)

    # The staged copy with 2-byte stores (ENCODE_VEC=0, the kernels of call 9 of 2026-12-04)
    # and with 16-byte stores (the library's).
    scalar = (("ENCODE_VEC", 0),)
    out["cuda_encode_staged_scalar_ms"] = (
        _time(lambda: encode_with(staged[0], scalar), repeats) * 1e3
    )
    got_scalar = (index.clone(), values.clone())
    index.zero_()
    values.zero_()
    out["cuda_encode_staged_ms"] = _time(lambda: encode_with(staged[0]), repeats) * 1e3
    got_staged = (index.clone(), values.clone())

    def cuda_encode() -> None:
        encode_with(enc_t)

    def tri_encode() -> None:
        jit.encode_runs_kernel[(chunks,)](
            enc_t, first_t, 1, counts, excl, wbits, LOG=1, num_warps=delta._ENCODE_WARPS,
            DTYPE=tl_int16, CHUNK=delta.CHUNK_ELEMENTS, BLOCK=delta._ENCODE_BLOCK,
        )  # fmt: skip

    out["cuda_encode_ms"] = _time(cuda_encode, repeats) * 1e3
    got = (index.clone(), values.clone())
    out["triton_encode_ms"] = _time(tri_encode, repeats) * 1e3
    out["encode_equal"] = float(
        torch.equal(got[0], index)
        and torch.equal(got[1], values)
        and torch.equal(got_staged[0], index)
        and torch.equal(got_staged[1], values)
        and torch.equal(got_scalar[0], index)
        and torch.equal(got_scalar[1], values)
    )
    dst = b.clone()
    row = [dst.data_ptr(), offsets.data_ptr(), index.data_ptr(), values.data_ptr(), n, 0, 0, 0]
    app = delta._device_table([row], [chunks], dev)
    assert app is not None
    app_t = app[0]

    def cuda_apply() -> None:
        cu._launch(dev, "apply_2", chunks, 256, (app_t.data_ptr(), first_t.data_ptr()), 1)

    def tri_apply() -> None:
        jit.apply_runs_kernel[(chunks,)](
            app_t, first_t, 1, LOG=1, num_warps=delta._APPLY_WARPS, DTYPE=tl_int16,
            CHUNK=delta.CHUNK_ELEMENTS, TILE=delta._APPLY_TILE,
        )  # fmt: skip

    exact = True
    for name, fn in (("cuda", cuda_apply), ("triton", tri_apply)):
        dst.copy_(b)
        out[f"{name}_apply_ms"] = _time(fn, repeats) * 1e3
        exact = exact and bool(torch.equal(dst, a))
    # A baseline from torch: its scatter of the same values to the same positions (int64
    # positions made beforehand, not timed): the rate of these scattered 2-byte writes.
    pos = torch.repeat_interleave(
        torch.arange(chunks, device=dev) * delta.CHUNK_ELEMENTS, counts
    ) + (index.to(torch.int64) & 0xFFFF)
    dst.copy_(b)
    out["torch_scatter_ms"] = _time(lambda: dst.scatter_(0, pos, values), repeats) * 1e3
    exact = exact and bool(torch.equal(dst, a))
    # The ceiling of these writes: the least a scatter to the same positions does, one thread
    # per entry reading a 4-byte position (coalesced) and writing 2 bytes there: with the
    # entry's value (2 more bytes read), and a constant (nothing else read; timing only, the
    # bytes are restored after). Apply reads 2 + 2 bytes per entry and each chunk's offsets.
    import cupy
    import numpy as np

    ceiling = cupy.RawKernel(_CEILING_SOURCE, "scatter_ceiling")
    pos32 = pos.to(torch.int32)
    entries = pos32.numel()
    grid = (entries + 255) // 256
    stream = cu._stream(int(torch.cuda.current_stream(dev).cuda_stream))

    def scatter_ceiling(with_values: int) -> None:
        ptrs = (dst.data_ptr(), pos32.data_ptr(), values.data_ptr())
        args = (*(np.uint64(p) for p in ptrs), np.int64(entries), np.int32(with_values))
        with cupy.cuda.Device(dev.index), stream:
            ceiling((grid,), (256,), args)

    dst.copy_(b)
    out["ceiling_scatter_values_ms"] = _time(lambda: scatter_ceiling(1), repeats) * 1e3
    exact = exact and bool(torch.equal(dst, a))
    out["ceiling_scatter_constant_ms"] = _time(lambda: scatter_ceiling(0), repeats) * 1e3
    out["apply_exact"] = float(exact)
    return out


_CEILING_SOURCE = r"""
extern "C" __global__ void scatter_ceiling(unsigned short* dst, const int* pos,
                                           const unsigned short* val, long long n, int with) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[pos[i]] = with ? val[i] : (unsigned short)0x3f80;
}
"""


def main(argv: list[str] | None = None) -> int:
    """Measure and print JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--densities", type=float, nargs="+", default=[0.0078, 0.054])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sweep", action="store_true", help="also time the kernels alone")
    p.add_argument("--json", default="")
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    n = int(ns.gib * 2**30) // 2
    old = torch.randn(n, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(old)
    rows = []
    ok = True
    for density in ns.densities:
        new = old.clone()
        a, b = int_view(new), int_view(old)
        mask = torch.rand(n, device=dev) < density
        a[mask] ^= 1
        del mask
        same = True
        for runs in ([(0, n)], _split(n)):
            patches = []
            for name in _SETS:
                delta.use_kernels(name)
                patches.append(_patch(a, b, runs))
            same = same and all(
                torch.equal(x, y) for x, y in zip(patches[0], patches[1], strict=True)
            )
            del patches
        row: dict[str, object] = {"density": density, "patches_equal": same}
        if ns.sweep:
            alone = _sweep(a, b, ns.repeats)
            alone["copy_ms"] = _time(lambda: dst.copy_(old), ns.repeats) * 1e3
            row["kernels_alone"] = alone
            print(json.dumps(alone), flush=True)
        copies = []
        for r in range(ns.rounds):
            copies.append(_time(lambda: dst.copy_(old), ns.repeats))
            for name in _SETS if r % 2 == 0 else reversed(_SETS):
                delta.use_kernels(name)
                for label, runs in (("one_run", [(0, n)]), ("llama_runs", _split(n))):
                    t = _tables(a, b, dst, old, runs, ns.repeats)
                    key = f"{name}_{label}"
                    got = row.setdefault(key, {"encode_s": [], "count_s": [], "apply_s": []})
                    assert isinstance(got, dict)
                    for k in ("encode_s", "count_s", "apply_s"):
                        got[k] += t[k]
                    got["bit_exact"] = bool(got.get("bit_exact", True)) and bool(t["bit_exact"])
        t_copy = statistics.median(copies)
        row["copy_s"] = copies
        for name in _SETS:
            for label in ("one_run", "llama_runs"):
                got = row[f"{name}_{label}"]
                assert isinstance(got, dict)
                for k in ("encode_s", "count_s", "apply_s"):
                    xs = got[k]
                    got[k.replace("_s", "")] = {
                        "min_ms": min(xs) * 1e3,
                        "median_ms": statistics.median(xs) * 1e3,
                        "max_ms": max(xs) * 1e3,
                        "median_vs_copy": statistics.median(xs) / t_copy,
                    }
                ok = ok and bool(got["bit_exact"])
        ok = ok and same
        rows.append(row)
        summary = {
            f"{name}_{label}": {
                k: round(row[f"{name}_{label}"][k]["median_vs_copy"], 3)  # type: ignore[index]
                for k in ("encode", "count", "apply")
            }
            for name in _SETS
            for label in ("one_run", "llama_runs")
        }
        print(
            json.dumps({"density": density, "copy_ms": t_copy * 1e3, "equal": same, **summary}),
            flush=True,
        )
    # Host work of one whole call: the same calls over one chunk of 65,536 elements.
    small_old = old[: delta.CHUNK_ELEMENTS].clone()
    small_new = small_old.clone()
    small_a, small_b = int_view(small_new), int_view(small_old)
    small_a[::100] ^= 1
    small_dst = torch.empty_like(small_old)
    one_chunk: dict[str, object] = {}
    for name in _SETS:
        delta.use_kernels(name)
        t = _tables(small_a, small_b, small_dst, small_old, [(0, small_a.numel())], ns.repeats)
        ok = ok and bool(t["bit_exact"])
        one_chunk[name] = {
            k: statistics.median(t[k]) * 1e3  # type: ignore[arg-type]
            for k in ("encode_s", "count_s", "apply_s")
        }
    print(json.dumps({"one_chunk_whole_calls_ms": one_chunk}), flush=True)
    delta.use_kernels("auto")
    out = {
        "gpu": torch.cuda.get_device_name(dev),
        "bytes": 2 * n,
        "rows": rows,
        "one_chunk_whole_calls_ms": one_chunk,
    }
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
