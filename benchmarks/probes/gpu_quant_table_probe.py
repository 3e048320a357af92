"""FP8 quantize kernels on one GPU (nvidia-h200): the per-call kernel against one `QuantTable`
launch, for Llama-8B's dense matrices and one Qwen3-30B-A3B MoE layer's 128 experts.

Every variant is checked bit for bit against the per-call kernel (outputs poisoned first; the
per-call kernel is itself checked against the CPU reference by gpu_fp8_kernel_check.py), and
timed with CUDA events (median of 7 after 2 warm-ups). The ceiling is torch's copy_ rate r on
the same GPU: a quantization that reads S bytes and writes W bytes cannot beat (S + W) / r.
Prints a table, writes JSON to argv[1].
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import torch

from weight_transfer.benchmarks.probes.gpu_table_copy_probe import _time
from weight_transfer.kernels.fp8_triton import QuantTable, quantize_fp8_blockwise_gpu
from weight_transfer.planner.fp8 import scale_shape


def _workloads(dev: torch.device) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator(device=dev).manual_seed(0)

    def mat(r: int, c: int) -> torch.Tensor:
        return torch.randn(r, c, device=dev, dtype=torch.bfloat16, generator=g)

    llama = [mat(6144, 4096), mat(4096, 4096), mat(28672, 4096), mat(4096, 14336)] * 4
    experts_w13 = torch.randn(128, 1536, 2048, device=dev, dtype=torch.bfloat16, generator=g)
    experts_w2 = torch.randn(128, 2048, 768, device=dev, dtype=torch.bfloat16, generator=g)
    qwen = [experts_w13[e] for e in range(128)] + [experts_w2[e] for e in range(128)]
    qwen = qwen * 4  # four MoE layers' worth, ~6.4 GB
    return {"llama8b_4layers": llama, "qwen3_moe_4layers_experts": qwen}


def _copy_time(dev: torch.device, n: int) -> float:
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return statistics.median(_time(lambda: b.copy_(a)))


def main() -> None:
    dev = torch.device("cuda", 0)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "cases": []}
    n = 4 << 30
    t = _copy_time(dev, n)
    rate = 2 * n / t
    res["copy_rate_Bps"] = rate
    print(f"copy_ 4 GiB: {t * 1e3:.3f} ms, r = {rate / 1e12:.2f} TB/s (read + write)")
    for wname, xs in _workloads(dev).items():
        outs = []
        for x in xs:
            q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=dev)
            s = torch.empty(
                scale_shape(tuple(x.shape), (128, 128)), dtype=torch.float32, device=dev
            )
            outs.append((x, q, s))
        nread = sum(x.numel() * 2 for x in xs)
        nwrite = sum(q.numel() + s.numel() * 4 for _, q, s in outs)
        ceiling = (nread + nwrite) / rate

        def per_call(warps: int = 8, outs: list = outs) -> None:
            for x, q, s in outs:
                quantize_fp8_blockwise_gpu(x, out_q=q, out_scale=s, num_warps=warps)

        per_call()
        torch.cuda.synchronize()
        want = [(q.view(torch.uint8).clone(), s.clone()) for _, q, s in outs]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            per_call()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            per_call()
        variants = {"per_call_w8": per_call, "per_call_graph_w8": graph.replay}
        grid: list[tuple[int, int, int | None]] = [
            (w, sub, None) for w in (8, 16) for sub in (16, 32, 64)
        ]
        grid += [(w, 32, st) for w in (4, 8) for st in (1, 2, 4)]
        for warps, sub, stages in grid:
            table = QuantTable(outs, (128, 128), num_warps=warps, sub_rows=sub, num_stages=stages)
            variants[f"table_w{warps}_sub{sub}_st{stages or 'default'}"] = table.launch
        for vname, fn in variants.items():
            for _, q, s in outs:
                q.view(torch.uint8).fill_(0x5A)
                s.fill_(-7.0)
            fn()
            torch.cuda.synchronize()
            ok = all(
                torch.equal(q.view(torch.uint8), wq) and torch.equal(s, ws)
                for (_, q, s), (wq, ws) in zip(outs, want, strict=True)
            )
            times = _time(fn)
            med = statistics.median(times)
            row = {
                "workload": wname,
                "variant": vname,
                "calls": len(outs),
                "read_bytes": nread,
                "write_bytes": nwrite,
                "seconds": times,
                "median_s": med,
                "ceiling_s": ceiling,
                "ratio": med / ceiling,
                "exact": ok,
            }
            res["cases"].append(row)
            print(
                f"{wname:28s} {vname:18s} {med * 1e3:8.3f} ms  ceiling {ceiling * 1e3:7.3f} ms"
                f"  {med / ceiling:5.2f}x  exact={ok}"
            )
        del outs, want, graph
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
