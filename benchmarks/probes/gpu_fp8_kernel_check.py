"""Check the Triton FP8 block quantizer bit for bit on a GPU, then time it against a D2D copy.

Run from the repository root on a CUDA machine with triton:

    python benchmarks/probes/gpu_fp8_kernel_check.py --json /tmp/fp8_kernel.json

1. Correctness (before any timing): for every case, the fp8 bytes (viewed as uint8) and the
   float32 scales must be `torch.equal` to `planner.fp8.quantize_fp8_blockwise` evaluated on
   the CPU (the documented IEEE semantics). Cases: Llama/DeepSeek-sized and odd shapes, 3-D
   expert stacks, bf16/fp16/fp32 inputs, magnitudes over 8 decades, all-zero blocks, strided
   inputs, writes into slices of larger buffers and into pinned host memory, the hardware and
   software fp8 casts. Informational: whether the same reference evaluated on the *GPU* agrees
   with itself on the CPU (PyTorch's CUDA `tensor / python_scalar` multiplies by a rounded
   reciprocal, so the scales are expected to differ in the last bit for many blocks).
2. Timing: Llama-3.1-8B matrix shapes (bf16 in, fp8 + scales out), median of CUDA-event timings
   after warm-up with L2 flushed before every repeat; GB/s counts bytes read + bytes written.
   Host cost per call is measured on its own (back-to-back calls on a 128x128 matrix).
   The baseline is a device-to-device `copy_` of the input tensor timed the same way in the
   same run (its GB/s also counts read + written). A num_warps sweep on two shapes follows.

Exit status: 0 all checks passed; 1 a mismatch (or a check raised); 2 no CUDA/triton here.
Everything printed is also written to --json PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weight_transfer.kernels.fp8_triton import (  # noqa: E402
    quantize_fp8,
    quantize_fp8_blockwise_gpu,
    triton_available,
)
from weight_transfer.planner.fp8 import quantize_fp8_blockwise, scale_shape  # noqa: E402

BLOCK = (128, 128)
SENTINEL = 0x5A

# Shapes checked bit for bit in bf16 and fp32: model-sized, not multiples of 128, expert stacks.
CHECK_SHAPES: list[tuple[int, ...]] = [
    (7168, 2048),
    (4096, 14336),
    (704, 256),
    (1000, 300),
    (8, 768, 256),
    (6144, 4096),
    (129, 127),
    (5, 7),
    (2, 3, 300, 260),
]

# Llama-3.1-8B (hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128, vocab 128256), tp=1:
# (label, shape, matrices per model). Embedding and lm_head usually stay bf16 in FP8
# checkpoints, so they are timed but left out of the per-model total.
LLAMA_8B_SHAPES: list[tuple[str, tuple[int, int], int]] = [
    ("qkv_proj", (6144, 4096), 32),
    ("o_proj", (4096, 4096), 32),
    ("gate_up_proj", (28672, 4096), 32),
    ("down_proj", (4096, 14336), 32),
    ("lm_head", (128256, 4096), 0),
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig:
    """What to run; filled from the command line."""

    json_path: str | None
    """Where to write the JSON report (None: do not write)."""
    device_index: int
    """CUDA device to run on."""
    warmup_iters: int
    """Untimed runs before timing each shape."""
    repeat_iters: int
    """Timed runs per shape (the median is reported)."""
    flush_bytes: int
    """Size of the buffer zeroed before each timed run to evict L2 (H200 L2 is 60 MB)."""
    seed: int
    """Seed of all generated data."""
    skip_timing: bool
    """Only run the correctness checks."""

    def __post_init__(self) -> None:
        if self.warmup_iters < 0 or self.repeat_iters < 1:
            raise ValueError("warmup_iters must be >= 0 and repeat_iters >= 1")
        if self.flush_bytes < 0:
            raise ValueError("flush_bytes must be >= 0")


def parse_args(argv: list[str] | None = None) -> CheckConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--device", dest="device_index", type=int, default=0)
    p.add_argument("--warmup", dest="warmup_iters", type=int, default=5)
    p.add_argument("--repeats", dest="repeat_iters", type=int, default=30)
    p.add_argument("--flush-mib", type=int, default=256, help="L2 flush buffer size, MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-timing", action="store_true")
    a = p.parse_args(argv)
    return CheckConfig(
        json_path=a.json_path,
        device_index=a.device_index,
        warmup_iters=a.warmup_iters,
        repeat_iters=a.repeat_iters,
        flush_bytes=a.flush_mib << 20,
        seed=a.seed,
        skip_timing=a.skip_timing,
    )


# ---------------------------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------------------------


def make_data(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: torch.device
) -> torch.Tensor:
    """Seeded normal data scaled per row and column over 1e-4..1e4, with an all-zero block,
    a block of tiny values and negative zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    *lead, rows, cols = shape
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    row_mag = 10.0 ** torch.empty(rows, 1, device=device).uniform_(-2, 2, generator=g)
    col_mag = 10.0 ** torch.empty(cols, device=device).uniform_(-2, 2, generator=g)
    x = x * row_mag * col_mag
    if rows > 256 and cols > 256:
        x[..., 128:256, 128:256] = 0.0  # all-zero block: scale is the floor, q all zero
        x[..., 0:128, 128:256] *= 1e-20  # tiny block: scale far below 1
    if rows > 8 and cols > 8:
        x[..., 5, 5] = -0.0
    return x.to(dtype)


def conversion_block(device: torch.device) -> torch.Tensor:
    """128x256: every e4m3 value, every midpoint and its float neighbours, at scale exactly 1
    (amax 448) and at scale 1/7."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    mids = (codes[:-1] + codes[1:]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    values = torch.cat([codes, mids, up, down])
    values = torch.cat([values, -values, torch.tensor([448.0, -448.0, -0.0])])
    g = torch.Generator().manual_seed(7)
    block = torch.empty(128 * 128).uniform_(-448.0, 448.0, generator=g)
    block[: values.numel()] = values
    block[-1] = 448.0
    block = block.reshape(128, 128)
    return torch.cat([block, block / 7.0], dim=1).to(device)


# ---------------------------------------------------------------------------------------------
# Correctness.
# ---------------------------------------------------------------------------------------------


def compare(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    """Bit comparison of (q, scale) pairs; counts of differing fp8 bytes and scales."""
    gq, gs = (t.detach().cpu() for t in got)
    wq, ws = (t.detach().cpu() for t in want)
    if gq.shape != wq.shape or gs.shape != ws.shape or gq.dtype != wq.dtype:
        return {
            "ok": False,
            "error": f"shape/dtype mismatch: got {tuple(gq.shape)} {gq.dtype} "
            f"{tuple(gs.shape)}, want {tuple(wq.shape)} {wq.dtype} {tuple(ws.shape)}",
        }
    gb, wb = gq.view(torch.uint8), wq.view(torch.uint8)
    bad_q = int((gb != wb).sum())
    bad_s = int((gs.view(torch.int32) != ws.view(torch.int32)).sum())
    ok = torch.equal(gb, wb) and torch.equal(gs, ws)
    return {"ok": ok and bad_q == 0 and bad_s == 0, "bad_fp8_bytes": bad_q, "bad_scales": bad_s}


def cpu_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_blockwise(x.cpu(), BLOCK)


def check_cases(cfg: CheckConfig, dev: torch.device) -> list[dict[str, Any]]:
    cases: list[tuple[str, Callable[[], dict[str, Any]]]] = []

    for i, shape in enumerate(CHECK_SHAPES):
        for dtype in (torch.bfloat16, torch.float32):

            def run(
                shape: tuple[int, ...] = shape, dtype: torch.dtype = dtype, seed: int = cfg.seed + i
            ) -> dict[str, Any]:
                x = make_data(shape, dtype, seed, dev)
                return compare(quantize_fp8_blockwise_gpu(x, BLOCK), cpu_ref(x))

            cases.append((f"{'x'.join(map(str, shape))} {str(dtype).split('.')[-1]}", run))

    def fp16() -> dict[str, Any]:
        x = make_data((1024, 640), torch.float16, cfg.seed + 100, dev)
        return compare(quantize_fp8_blockwise_gpu(x, BLOCK), cpu_ref(x))

    def cast_rounding(software: bool) -> dict[str, Any]:
        x = conversion_block(dev)
        return compare(quantize_fp8_blockwise_gpu(x, BLOCK, software_cast=software), cpu_ref(x))

    def software_cast_big() -> dict[str, Any]:
        x = make_data((4096, 4096), torch.bfloat16, cfg.seed + 101, dev)
        hw = quantize_fp8_blockwise_gpu(x, BLOCK, software_cast=False)
        sw = quantize_fp8_blockwise_gpu(x, BLOCK, software_cast=True)
        return compare(sw, hw) | {"vs_cpu": compare(hw, cpu_ref(x))["ok"]}

    def odd_blocks() -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True}
        x = make_data((300, 350), torch.float32, cfg.seed + 102, dev)
        for block in [(96, 80), (1, 128), (64, 64), (128, 256)]:
            r = compare(
                quantize_fp8_blockwise_gpu(x, block), quantize_fp8_blockwise(x.cpu(), block)
            )
            out[str(block)] = r
            out["ok"] = out["ok"] and r["ok"]
        return out

    def strided_in_out_slices() -> dict[str, Any]:
        big = make_data((2, 1100, 2200), torch.bfloat16, cfg.seed + 103, dev)
        x = big[:, 37:1037, 64:2112]  # 1000 x 2048 views, row stride 2200
        q_buf = torch.full((3, 1010, 2100), SENTINEL, dtype=torch.uint8, device=dev)
        s_buf = torch.full((3, 10, 20), -1.0, device=dev)
        out_q = q_buf[1:, 5:1005, 16:2064].view(torch.float8_e4m3fn)
        out_s = s_buf[1:, 1:9, 2:18]
        quantize_fp8_blockwise_gpu(x, BLOCK, out_q=out_q, out_scale=out_s)
        r = compare((out_q, out_s), cpu_ref(x.contiguous()))
        q_buf[1:, 5:1005, 16:2064] = SENTINEL
        s_buf[1:, 1:9, 2:18] = -1.0
        untouched = bool((q_buf == SENTINEL).all()) and bool((s_buf == -1.0).all())
        return r | {"ok": r["ok"] and untouched, "outside_untouched": untouched}

    def transposed_and_unfoldable() -> dict[str, Any]:
        base = make_data((8, 512, 768), torch.bfloat16, cfg.seed + 104, dev)
        views = {
            "transposed": base[0].t(),  # last-dim stride 768
            "unfoldable": base.view(2, 4, 512, 768)[:, 1:, :, 100:700],
            "experts_interleaved": base.reshape(8, 512, 3, 256).permute(0, 2, 1, 3)[:, 1],
        }
        out: dict[str, Any] = {"ok": True}
        for label, v in views.items():
            r = compare(quantize_fp8_blockwise_gpu(v, BLOCK), cpu_ref(v.contiguous()))
            out[label] = r
            out["ok"] = out["ok"] and r["ok"]
        return out

    def pinned_host_out() -> dict[str, Any]:
        x = make_data((2048, 1024), torch.bfloat16, cfg.seed + 105, dev)
        out_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn).pin_memory()
        out_s = torch.empty(scale_shape(tuple(x.shape), BLOCK)).pin_memory()
        quantize_fp8_blockwise_gpu(x, BLOCK, out_q=out_q, out_scale=out_s)
        torch.cuda.synchronize(dev)
        return compare((out_q, out_s), cpu_ref(x))

    def dispatcher() -> dict[str, Any]:
        x = make_data((768, 512), torch.bfloat16, cfg.seed + 106, dev)
        gpu = quantize_fp8(x, BLOCK)
        cpu = quantize_fp8(x.cpu(), BLOCK)
        return compare(gpu, cpu) | {"q_on_cuda": gpu[0].is_cuda}

    def big_expert_stack() -> dict[str, Any]:
        # 16 experts x (2*1408) x 2048 (DeepSeek-V2-Lite-like w13 slice): 5632 programs.
        x = make_data((16, 2816, 2048), torch.bfloat16, cfg.seed + 107, dev)
        return compare(quantize_fp8_blockwise_gpu(x, BLOCK), cpu_ref(x))

    cases += [
        ("1024x640 float16", fp16),
        ("cast rounding, hardware cast", lambda: cast_rounding(False)),
        ("cast rounding, software cast", lambda: cast_rounding(True)),
        ("software cast == hardware cast 4096x4096", software_cast_big),
        ("non-128 blocks", odd_blocks),
        ("strided input into out= slices", strided_in_out_slices),
        ("transposed / unfoldable / interleaved views", transposed_and_unfoldable),
        ("out= in pinned host memory", pinned_host_out),
        ("dispatcher cuda == cpu", dispatcher),
        ("16x2816x2048 expert stack", big_expert_stack),
    ]

    results = []
    for label, fn in cases:
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as exc:  # report and go on: one broken case must not hide the rest
            r = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(),
            }
        r = {"case": label, **r, "seconds": round(time.perf_counter() - t0, 3)}
        results.append(r)
        status = "ok  " if r["ok"] else "FAIL"
        detail = (
            ""
            if r["ok"]
            else "  " + json.dumps({k: v for k, v in r.items() if k not in ("case", "trace")})
        )
        print(f"  [{status}] {label}{detail}", flush=True)
    return results


def check_cuda_reference(cfg: CheckConfig, dev: torch.device) -> dict[str, Any]:
    """Does planner.fp8 evaluated on the GPU agree with itself on the CPU? (Informational.)"""
    x = make_data((7168, 2048), torch.bfloat16, cfg.seed + 200, dev)
    r = compare(quantize_fp8_blockwise(x, BLOCK), cpu_ref(x))
    r["num_scales"] = math.prod(scale_shape(tuple(x.shape), BLOCK))
    return r


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------


def time_cuda(fn: Callable[[], object], cfg: CheckConfig, flush: torch.Tensor) -> list[float]:
    """Milliseconds per call, one CUDA-event pair per call, L2 flushed before each."""
    for _ in range(cfg.warmup_iters):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.repeat_iters)]  # type: ignore[no-untyped-call]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.repeat_iters)]  # type: ignore[no-untyped-call]
    for s, e in zip(starts, ends, strict=True):
        if flush.numel():
            flush.zero_()
        # Keep the GPU busy ~0.5 ms so the host-side launch cost is hidden: events time the
        # GPU work only (host overhead per call is measured separately).
        torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def summarize(ms: list[float], traffic_bytes: int) -> dict[str, float]:
    med = statistics.median(ms)
    qs = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [med] * 9
    return {
        "median_ms": med,
        "p10_ms": qs[0],
        "p90_ms": qs[-1],
        "gbps": traffic_bytes / (med * 1e-3) / 1e9,
    }


def time_shape(
    shape: tuple[int, int], cfg: CheckConfig, flush: torch.Tensor, dev: torch.device, warps: int
) -> tuple[dict[str, float], dict[str, float], int]:
    """(quantizer timing, copy timing, input bytes) for one bf16 matrix of `shape`."""
    x = make_data(shape, torch.bfloat16, cfg.seed + 300, dev)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty(scale_shape(shape, BLOCK), dtype=torch.float32, device=dev)
    dst = torch.empty_like(x)
    in_bytes = x.numel() * x.element_size()
    quant_traffic = in_bytes + q.numel() + s.numel() * 4
    copy_traffic = 2 * in_bytes

    def quant() -> object:
        return quantize_fp8_blockwise_gpu(x, BLOCK, q, s, num_warps=warps)

    def copy() -> object:
        return dst.copy_(x)

    qt = summarize(time_cuda(quant, cfg, flush), quant_traffic)
    ct = summarize(time_cuda(copy, cfg, flush), copy_traffic)
    return qt, ct, in_bytes


def run_timing(cfg: CheckConfig, dev: torch.device) -> dict[str, Any]:
    flush = torch.empty(cfg.flush_bytes // 4, dtype=torch.int32, device=dev)
    rows_out = []
    total_ms = {"quant": 0.0, "copy": 0.0}
    total_bytes = 0
    print(
        f"\n  {'matrix':<14}{'shape':>14}{'quant ms':>10}{'quant GB/s':>12}"
        f"{'copy ms':>10}{'copy GB/s':>11}{'ratio':>7}"
    )
    for label, shape, per_model in LLAMA_8B_SHAPES:
        qt, ct, in_bytes = time_shape(shape, cfg, flush, dev, warps=8)
        ratio = qt["gbps"] / ct["gbps"]
        print(
            f"  {label:<14}{'x'.join(map(str, shape)):>14}{qt['median_ms']:>10.4f}"
            f"{qt['gbps']:>12.0f}{ct['median_ms']:>10.4f}{ct['gbps']:>11.0f}{ratio:>7.2f}",
            flush=True,
        )
        rows_out.append(
            {
                "matrix": label,
                "shape": list(shape),
                "matrices_per_model": per_model,
                "input_bytes": in_bytes,
                "quant": qt,
                "copy": ct,
                "quant_over_copy_gbps": ratio,
            }
        )
        total_ms["quant"] += per_model * qt["median_ms"]
        total_ms["copy"] += per_model * ct["median_ms"]
        total_bytes += per_model * in_bytes
    print(
        f"\n  Llama-3.1-8B linear layers ({total_bytes / 1e9:.2f} GB bf16, 224 matrices, tp=1): "
        f"quantize {total_ms['quant']:.2f} ms, plain copy {total_ms['copy']:.2f} ms"
    )

    # Host cost of one call (argument checks + triton launch) on a 128x128 matrix, where the
    # GPU work is negligible: matters for pipelines that quantize many small tensors.
    tiny = make_data((128, 128), torch.bfloat16, cfg.seed + 302, dev)
    tq = torch.empty(tiny.shape, dtype=torch.float8_e4m3fn, device=dev)
    ts = torch.empty((1, 1), dtype=torch.float32, device=dev)
    for _ in range(20):
        quantize_fp8_blockwise_gpu(tiny, BLOCK, tq, ts)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        quantize_fp8_blockwise_gpu(tiny, BLOCK, tq, ts)
    torch.cuda.synchronize()
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    print(f"  host cost per call (128x128, back to back): {host_us:.1f} us")

    sweep = []
    warps_list = (4, 8, 16)
    print("\n  num_warps sweep, quantizer GB/s:  " + "  ".join(f"w={w:<3}" for w in warps_list))
    for shape in [(28672, 4096), (4096, 14336)]:
        per_w = {str(w): time_shape(shape, cfg, flush, dev, warps=w)[0] for w in warps_list}
        sweep.append({"shape": list(shape), "by_num_warps": per_w})
        print(
            f"  {'x'.join(map(str, shape)):>32}  "
            + "  ".join(f"{per_w[str(w)]['gbps']:>5.0f}" for w in warps_list),
            flush=True,
        )
    return {
        "llama_3_1_8b": rows_out,
        "model_total_ms": total_ms,
        "model_total_bf16_bytes": total_bytes,
        "num_warps_sweep": sweep,
        "host_us_per_call": host_us,
    }


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    t_start = time.perf_counter()
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg)}

    def finish(code: int) -> int:
        report["exit_code"] = code
        report["wall_s"] = round(time.perf_counter() - t_start, 2)
        if cfg.json_path:
            Path(cfg.json_path).write_text(json.dumps(report, indent=2, default=str))
            print(f"\nJSON written to {cfg.json_path}")
        return code

    if not torch.cuda.is_available():
        print("ERROR: no CUDA device visible (torch.cuda.is_available() is False)")
        report["error"] = "no CUDA"
        return finish(2)
    if not triton_available():
        print("ERROR: triton cannot be imported (pip install triton)")
        report["error"] = "no triton"
        return finish(2)
    import triton

    dev = torch.device("cuda", cfg.device_index)
    torch.cuda.set_device(dev)
    report["env"] = {
        "gpu": torch.cuda.get_device_name(dev),
        "capability": list(torch.cuda.get_device_capability(dev)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    print("FP8 block-quantizer check:", json.dumps(report["env"]))
    if torch.cuda.get_device_capability(dev) < (8, 9):
        print("WARNING: the hardware e4m3 cast needs sm_89+; expect a compile error below")

    print("\nCorrectness vs planner.fp8.quantize_fp8_blockwise on the CPU (bit-exact):")
    cases = check_cases(cfg, dev)
    report["correctness"] = cases
    num_failed = sum(not c["ok"] for c in cases)

    cuda_ref = check_cuda_reference(cfg, dev)
    report["reference_on_cuda_vs_cpu"] = cuda_ref
    print(
        "\nInformational: planner.fp8 run on the GPU vs on the CPU (7168x2048 bf16): "
        f"{cuda_ref.get('bad_scales')} of {cuda_ref.get('num_scales')} scales and "
        f"{cuda_ref.get('bad_fp8_bytes')} fp8 bytes differ"
        + (
            " (torch CUDA divides by a Python scalar via a rounded reciprocal)"
            if not cuda_ref["ok"]
            else ""
        )
    )

    if num_failed:
        print(f"\nFAILED: {num_failed} of {len(cases)} correctness checks; no timing run")
        return finish(1)
    print(f"\nAll {len(cases)} correctness checks passed.")

    if not cfg.skip_timing:
        print(
            f"\nTiming (median of {cfg.repeat_iters} after {cfg.warmup_iters} warm-up, "
            f"L2 flushed, GB/s = bytes read + written per second):"
        )
        report["timing"] = run_timing(cfg, dev)
    return finish(0)


if __name__ == "__main__":
    sys.exit(main())
