"""Bandwidth of the delta kernels on a GPU against its memory bound (not run yet: docs/delta.md).

For a BF16 tensor of `--gib` GiB and each density: the count + encode pass (reads new and
snapshot: 2 N bytes; writes the patch) and the apply (reads the patch, scatters into N bytes),
each timed with CUDA events (median of `--repeats` after a warm-up), every round trip checked
bit-exact, beside a device-to-device copy of the same N bytes measured in the same run. The
memory bound of encode is the time to read 2 N bytes at the copy's rate (a copy of N bytes moves
2 N), so `encode_vs_bound` = t_encode / t_copy(N); apply's bound is reading and writing the
patch's entries, far below a copy; its ratio is given against t_copy(N) too.

    python benchmarks/probes/gpu_delta_kernel_probe.py --gib 4 --densities 0.005 0.02 0.08 \
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from weight_transfer.kernels.delta import apply_changes, diff_encode, int_view, num_chunks


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
