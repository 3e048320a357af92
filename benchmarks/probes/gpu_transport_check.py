"""GPU0 -> GPU1 one-sided writes through the ucx and nixl backends, beside an in-process peer copy.

Two spawned processes: the receiver owns GPU1 memory registered as a TARGET, the sender owns
GPU0 memory registered as a SOURCE and writes all of it per repeat. Before timing, each size
is written once and the receiver checks it with `torch.equal` against seeded random data; after
timing it is checked again. The baseline, measured in the same run, is `copy_` from a GPU0
tensor into a GPU1 tensor in one process (NVLink peer copy). Reports the median GB/s (and min,
max) of the repeats, and writes everything as JSON to --json.

    python benchmarks/probes/gpu_transport_check.py --json gpu_check.json
    python benchmarks/probes/gpu_transport_check.py --sizes-mib 16 64 256 1024 --repeats 10 \
        --backends ucx nixl --json out.json

Needs 2 CUDA GPUs, torch, and the ucx / nixl wheels importable (PYTHONPATH is fine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weight_transfer.backends.base import (  # noqa: E402
    RegionDescriptor,
    RegionRole,
    TransportConfig,
    WriteOp,
    create_transport,
)

QUEUE_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig:
    """What to run."""

    sizes_mib: tuple[int, ...] = (4, 16, 64, 256, 1024)
    """Bytes per write (one write per repeat), MiB."""
    repeats: int = 10
    """Timed repeats per size (after 2 warm-ups)."""
    backends: tuple[str, ...] = ("ucx", "nixl")
    """Backends to run."""
    options: tuple[tuple[str, str], ...] = ()
    """Extra backend options KEY=VALUE (same for every backend that accepts them)."""
    json_path: str = "gpu_transport_check.json"
    """Where to write the results."""

    def __post_init__(self) -> None:
        if self.repeats < 1 or not self.sizes_mib or min(self.sizes_mib) <= 0:
            raise ValueError("repeats and sizes must be positive")


def _seeded(nbytes: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)


def receiver(
    backend: str, options: Any, sizes: list[int], to_parent: Any, from_parent: Any
) -> None:
    """On GPU1: register a target per size, publish, then verify on request."""
    try:
        transport = create_transport(TransportConfig(name=backend, device_index=1, options=options))
        targets = {n: _seeded(n, 1000 + i, "cuda:1") for i, n in enumerate(sizes)}
        descs = {
            n: transport.register(t, role=RegionRole.TARGET).descriptor.to_bytes()  # type: ignore[union-attr]
            for n, t in targets.items()
        }
        to_parent.put(("ready", transport.endpoint(), descs))
        while True:
            msg = from_parent.get(timeout=QUEUE_TIMEOUT_S)
            if msg[0] == "stop":
                break
            _, nbytes, seed = msg
            torch.cuda.synchronize(1)
            ok = torch.equal(targets[nbytes], _seeded(nbytes, seed, "cuda:1"))
            to_parent.put(("checked", ok))
        transport.close()
    except BaseException:
        to_parent.put(("error", traceback.format_exc()))
        raise


def sender(
    backend: str,
    options: Any,
    endpoint: bytes,
    descs: dict[int, bytes],
    repeats: int,
    to_parent: Any,
    from_parent: Any,
) -> None:
    """On GPU0: for each size write once (verified), time `repeats` writes, verify again."""
    try:
        transport = create_transport(TransportConfig(name=backend, device_index=0, options=options))
        transport.connect("gpu1", endpoint)
        for nbytes, desc_bytes in sorted(descs.items()):
            seed = 7 + nbytes % 1000
            source = _seeded(nbytes, seed, "cuda:0")
            torch.cuda.synchronize(0)
            src = transport.register(source, role=RegionRole.SOURCE)
            desc = RegionDescriptor.from_bytes(desc_bytes)
            op = [WriteOp(src, 0, desc, 0, nbytes)]
            transport.wait(transport.post_writes("gpu1", op), timeout_s=60)
            to_parent.put(("verify", nbytes, seed))
            if not from_parent.get(timeout=QUEUE_TIMEOUT_S):
                raise RuntimeError(f"{backend}: {nbytes} bytes arrived wrong before timing")
            times = []
            for i in range(repeats + 2):
                t0 = time.perf_counter()
                transport.wait(transport.post_writes("gpu1", op), timeout_s=60)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            to_parent.put(("verify", nbytes, seed))
            if not from_parent.get(timeout=QUEUE_TIMEOUT_S):
                raise RuntimeError(f"{backend}: {nbytes} bytes arrived wrong after timing")
            to_parent.put(("times", nbytes, times))
            transport.deregister(src)
        transport.close()
        to_parent.put(("done",))
    except BaseException:
        to_parent.put(("error", traceback.format_exc()))
        raise


def _summary(nbytes: int, times: list[float]) -> dict[str, float]:
    rates = [nbytes / t / 1e9 for t in times]
    return {
        "median_gbps": statistics.median(rates),
        "min_gbps": min(rates),
        "max_gbps": max(rates),
        "median_s": statistics.median(times),
    }


def run_backend(backend: str, cfg: CheckConfig) -> dict[str, Any]:
    """Both processes for one backend; returns {size: summary} or an error."""
    ctx = mp.get_context("spawn")
    sizes = [mib << 20 for mib in cfg.sizes_mib]
    rx_out, rx_in, tx_out, tx_in = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=receiver, args=(backend, cfg.options, sizes, rx_out, rx_in))
    rx.start()
    procs = [rx]
    result: dict[str, Any] = {}
    try:
        msg = rx_out.get(timeout=QUEUE_TIMEOUT_S)
        if msg[0] != "ready":
            return {"error": msg[1]}
        tx = ctx.Process(
            target=sender,
            args=(backend, cfg.options, msg[1], msg[2], cfg.repeats, tx_out, tx_in),
        )
        tx.start()
        procs.append(tx)
        while True:
            msg = tx_out.get(timeout=QUEUE_TIMEOUT_S)
            if msg[0] == "verify":
                rx_in.put(("check", msg[1], msg[2]))
                reply = rx_out.get(timeout=QUEUE_TIMEOUT_S)
                ok = reply[0] == "checked" and reply[1]
                tx_in.put(ok)
                if not ok:
                    result.setdefault("errors", []).append(f"mismatch at {msg[1]} bytes: {reply}")
            elif msg[0] == "times":
                result[str(msg[1])] = _summary(msg[1], msg[2])
                print(
                    f"{backend:6s} {msg[1] >> 20:6d} MiB  "
                    f"{result[str(msg[1])]['median_gbps']:8.1f} GB/s",
                    flush=True,
                )
            elif msg[0] == "done":
                break
            else:
                result.setdefault("errors", []).append(msg[1])
                break
    except Exception:  # a queue timeout or a dead child: report, don't hang
        result.setdefault("errors", []).append(traceback.format_exc())
    finally:
        rx_in.put(("stop",))
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        result["exit_codes"] = [proc.exitcode for proc in procs]
    return result


def peer_copy(cfg: CheckConfig) -> dict[str, Any]:
    """In-process GPU0 -> GPU1 `copy_` (the NVLink baseline), same sizes and repeats."""
    out: dict[str, Any] = {"can_access_peer": torch.cuda.can_device_access_peer(0, 1)}
    for mib in cfg.sizes_mib:
        nbytes = mib << 20
        src = _seeded(nbytes, 3, "cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        dst.copy_(src)
        torch.cuda.synchronize(1)
        if not torch.equal(dst.cpu(), src.cpu()):
            out[str(nbytes)] = {"error": "peer copy mismatch"}
            continue
        times = []
        for i in range(cfg.repeats + 2):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[str(nbytes)] = _summary(nbytes, times)
        print(f"peer   {mib:6d} MiB  {out[str(nbytes)]['median_gbps']:8.1f} GB/s", flush=True)
    return out


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("libucx", "nixl_cu13"):
        try:
            from importlib.metadata import version

            found[mod] = version({"libucx": "libucx-cu13", "nixl_cu13": "nixl-cu13"}[mod])
        except Exception as exc:  # not installed or not found by metadata
            found[mod] = f"unavailable: {exc}"
    return found


def main(argv: list[str] | None = None) -> int:
    defaults = CheckConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=list(defaults.sizes_mib))
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--backends", nargs="+", default=list(defaults.backends))
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", default=defaults.json_path)
    args = parser.parse_args(argv)
    cfg = CheckConfig(
        sizes_mib=tuple(args.sizes_mib),
        repeats=args.repeats,
        backends=tuple(args.backends),
        options=tuple(tuple(o.split("=", 1)) for o in args.option),  # type: ignore[misc]
        json_path=args.json,
    )
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "versions": _versions(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
        "peer_copy": peer_copy(cfg),
    }
    for backend in cfg.backends:
        report[backend] = run_backend(backend, cfg)
    for backend in cfg.backends:
        for key, summary in report[backend].items():
            base = report["peer_copy"].get(key)
            if isinstance(summary, dict) and isinstance(base, dict) and "median_gbps" in base:
                summary["ratio_to_peer_copy"] = summary["median_gbps"] / base["median_gbps"]
    with open(cfg.json_path, "w") as f:
        json.dump(report, f, indent=2)
    failed = [b for b in cfg.backends if report[b].get("errors") or any(report[b]["exit_codes"])]
    print(f"wrote {cfg.json_path}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
