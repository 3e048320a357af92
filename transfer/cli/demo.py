"""`weight-transfer demo`: the main job, verified updates between real trainer and engine
processes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from weight_transfer.backends.base import BACKENDS
from weight_transfer.cli.command import Command


def _demo_args(p: argparse.ArgumentParser) -> None:
    from weight_transfer.planner.presets.models import MODEL_SHAPES

    dense = sorted(n for n, s in MODEL_SHAPES.items() if not s.num_experts)
    p.add_argument(
        "--backend",
        default=None,
        choices=sorted(BACKENDS),
        help="transport (default: the config file's, else loopback: the simulated "
        "backend, shared memory on this host); a --config file that names another is refused",
    )
    p.add_argument("--fp8", action="store_true", help="engines hold FP8 block-quantized weights")
    p.add_argument("--train-ranks", type=int, default=3, help="trainer processes (FSDP2, gloo)")
    p.add_argument("--engine-ranks", type=int, default=2, help="engine processes (tensor parallel)")
    p.add_argument("--steps", type=int, default=3, help="verified updates")
    p.add_argument(
        "--model",
        default="tiny",
        metavar="MODEL",
        help=f"model shape preset (a shape only: the weights are random), one of: "
        f"{', '.join(dense)}",
    )
    p.add_argument(
        "--trainer-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="trainer parameter dtype",
    )
    p.add_argument(
        "--timeout-s", type=float, default=300.0, help="limit for the whole run, start-up included"
    )
    p.add_argument(
        "--config",
        help="TOML file (weight_transfer.TransferConfig): its transport, options, [control], "
        "[planner], [sender] and [receiver] tables are used",
    )


def _control_fields(data: dict[str, Any], tc: Any) -> dict[str, Any]:
    """The demo's control-plane settings from the file's `[control]` table, if it has one."""
    if "control" not in data:
        return {}
    return {
        "control_host": tc.control.host,
        "control_port": tc.control.port,
        "control_token": tc.control.token,
    }


def _demo(ns: argparse.Namespace) -> int:
    from weight_transfer.cli.demo_memory import memory_problem
    from weight_transfer.cli.run_demo import DemoConfig, UpdateReport, preflight, run_demo
    from weight_transfer.config import config_from_mapping, merge, new_token, read_toml

    try:
        # The TOML file and the flags fill the same dataclass. Without a [control] table the
        # demo's processes share a fresh token and free ports of their own.
        file_data = read_toml(ns.config) if ns.config else {}
        data = merge({"control": {"token": new_token()}}, file_data)
        if ns.backend is not None:
            named = file_data.get("transport")
            if named is not None and named != ns.backend:
                raise ValueError(
                    f"--backend {ns.backend} conflicts with transport = {named!r} in "
                    f"{ns.config}: give one of them"
                )
            data = merge(data, {"transport": ns.backend})
        tc = config_from_mapping(data)
        cfg = DemoConfig(
            backend=tc.transport,
            fp8=ns.fp8,
            train_ranks=ns.train_ranks,
            engine_ranks=ns.engine_ranks,
            steps=ns.steps,
            model=ns.model,
            trainer_dtype=ns.trainer_dtype,
            timeout_s=ns.timeout_s,
            transport_options=tc.transport_options,
            planner=tc.planner,
            sender=tc.sender if "sender" in file_data else None,
            receiver=tc.receiver,
            **_control_fields(file_data, tc),
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = preflight(cfg) or memory_problem(cfg)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(
        f"demo: {cfg.train_ranks} trainer ranks (FSDP2, {cfg.trainer_dtype}) -> {cfg.engine_ranks} "
        f"engine ranks (vLLM tp={cfg.engine_ranks}, {'FP8' if cfg.fp8 else 'BF16'}), model "
        f"{cfg.model!r} (a shape preset: random weights), backend {cfg.backend!r}",
        flush=True,
    )

    def show(u: UpdateReport) -> None:
        status = (
            "ok"
            if not u.mismatches
            else f"MISMATCH in {len(u.mismatches)} tensors: {', '.join(u.mismatches[:5])}"
        )
        print(
            f"update {u.step}: {u.seconds * 1e3:.1f} ms, {u.nbytes / 1e6:.2f} MB, "
            f"{u.gbps:.2f} GB/s, {status}",
            flush=True,
        )

    result = run_demo(cfg, on_update=show)
    for e in result.errors:
        print(f"error: {e}", file=sys.stderr)
    if result.ok:
        n = len(result.updates)
        print(f"verified {n} update(s): every engine tensor equals the reference bit for bit")
        return 0
    print("FAILED: see errors above", file=sys.stderr)
    return 1


COMMANDS = (
    Command(
        "demo",
        "run verified updates between real trainer and engine processes on this machine",
        _demo_args,
        _demo,
    ),
)
