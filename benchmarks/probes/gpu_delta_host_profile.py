"""Where the host time of a delta count + encode goes, on a GPU: the library's whole calls
(`count_runs` + `encode_runs`, as `gpu_delta_cuda_probe` times them) over one chunk of 65,536
BF16 elements, so that the kernels take microseconds and what is left is host work and
synchronization. Per kernel set: the median wall time of a call, then the same calls under
cProfile (its overhead inflates every Python function; read the shares, not the totals).

    python benchmarks/probes/gpu_delta_host_profile.py --calls 300 --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from weight_transfer.kernels import delta
from weight_transfer.kernels.delta import count_runs, encode_runs, int_view, num_chunks


def main(argv: list[str] | None = None) -> int:
    """Measure, profile, print."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sets", nargs="+", default=["cuda", "triton"])
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    n = delta.CHUNK_ELEMENTS
    old = torch.randn(n, device=dev).to(torch.bfloat16)
    new = old.clone()
    a, b = int_view(new), int_view(old)
    a[::100] ^= 1
    ok = True
    for name in ns.sets:
        delta.use_kernels(name)
        counted = count_runs([a], [b])
        total = int(counted.totals[0])
        out = [
            (
                0,
                torch.empty(num_chunks(n) + 1, dtype=torch.int64, device=dev),
                torch.empty(total, dtype=torch.int16, device=dev),
                torch.empty(total, dtype=a.dtype, device=dev),
            )
        ]

        def call(o: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = out) -> None:
            encode_runs(count_runs([a], [b]), o)
            torch.cuda.synchronize(dev)

        for _ in range(20):
            call()
        walls = []
        for _ in range(ns.calls):
            t0 = time.perf_counter()
            call()
            walls.append(time.perf_counter() - t0)
        want = (a != b).nonzero().reshape(-1)
        ok = ok and bool(torch.equal(out[0][2].to(torch.int64) & 0xFFFF, want))
        ok = ok and bool(torch.equal(out[0][3], a[want]))
        print(
            f"== {name}: count_runs + encode_runs on one chunk, {ns.calls} calls: "
            f"min / median / max {min(walls) * 1e3:.3f} / {statistics.median(walls) * 1e3:.3f}"
            f" / {max(walls) * 1e3:.3f} ms; patch exact: {ok}",
            flush=True,
        )
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(ns.calls):
            call()
        prof.disable()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(ns.top)
            print(f"-- {name}, by {key}:\n{s.getvalue()}", flush=True)
    delta.use_kernels("auto")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
