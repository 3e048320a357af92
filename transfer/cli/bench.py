"""`weight-transfer bench transports|update|control-plane`: benchmarks beside baselines.

`bench transports` runs `weight_transfer.benchmarks.transport_harness` (a receiver and a sender
process per backend, baselines in the same run), prints a table with ratios, and optionally writes
the JSON and a PNG plot. `bench update` runs `weight_transfer.benchmarks.bench_update` (whole
updates on GPUs beside their ceiling and baselines). `bench control-plane` runs
`weight_transfer.benchmarks.bench_control_plane` (the control plane's store requests and commit
latency at 8, 64 and 384 members, as threads of one process).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from weight_transfer.backends.base import BACKENDS
from weight_transfer.cli.command import Command


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="{transports,update,control-plane}")
    t = sub.add_parser(
        "transports",
        help="one-sided write throughput per backend and size, beside raw baselines",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _transports_args(t)
    from weight_transfer.benchmarks import bench_update

    u = sub.add_parser(
        "update",
        help="whole verified updates on GPUs beside the ceiling and the rank-0 baseline",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench_update.build_parser(u)
    from weight_transfer.benchmarks import bench_control_plane

    c = sub.add_parser(
        "control-plane",
        help="the control plane's store requests and commit latency at 8, 64 and 384 members",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench_control_plane.build_parser(c)


def _transports_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backends",
        default="loopback,tcp,ucx,nixl",
        help=f"comma-separated, from {','.join(sorted(BACKENDS))} (default: %(default)s)",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated message sizes (default: 4KiB,64KiB,1MiB,16MiB,64MiB; "
        "and 256MiB with --device cuda)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: host memory; cuda: sender on GPU0 writes into a receiver on GPU1",
    )
    p.add_argument("--rounds", type=int, default=20, help="timed samples per case (default 20)")
    p.add_argument("--warmup-rounds", type=int, default=3, help="untimed samples first (default 3)")
    p.add_argument(
        "--min-sample-bytes",
        default="8MiB",
        help="each sample writes at least this much, in messages of the size (default 8MiB)",
    )
    p.add_argument(
        "--memcpy-threads", type=int, default=1, help="torch threads of the memcpy baseline"
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="BACKEND:KEY=VALUE",
        help="a backend option of both sides (repeatable), e.g. ucx:TLS=cma or "
        "nixl:segment_bytes=33554432",
    )
    for role in ("receiver", "sender"):
        p.add_argument(
            f"--{role}-option",
            action="append",
            default=[],
            metavar="BACKEND:KEY=VALUE",
            help=f"a backend option of the {role}'s side only (repeatable; replaces that key of "
            f"--option), e.g. ibverbs:device={'rxe0' if role == 'receiver' else 'rxe1'}",
        )
        p.add_argument(
            f"--{role}-host",
            default="127.0.0.1",
            metavar="ADDRESS",
            help=f"the {role}'s address: its transports listen on it"
            + (
                " and the socket baseline listens on it"
                if role == "receiver"
                else "; the socket baseline connects from it"
            ),
        )
    p.add_argument(
        "--baselines",
        default=None,
        metavar="NAMES",
        help="comma-separated baselines (cpu: socket,memcpy,ib_write_bw; cuda: peer_copy); "
        "default: socket,memcpy on cpu (and ib_write_bw with --rdma-devices), peer_copy on cuda",
    )
    p.add_argument(
        "--rdma-devices",
        default=None,
        metavar="RECV_DEV,SEND_DEV",
        help="RDMA devices of the receiver and the sender, e.g. rxe0,rxe1: adds the ib_write_bw "
        "baseline (perftest) between them, the ceiling of an RDMA run",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip the raw baselines")
    p.add_argument("--timeout-s", type=float, default=120.0, help="limit of any single wait")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write every sample as JSON")
    p.add_argument(
        "--plot", dest="plot_path", metavar="PATH", help="write a PNG plot (needs matplotlib)"
    )


def _parse_option(text: str, flag: str = "--option") -> tuple[str, str, str]:
    backend, sep, rest = text.partition(":")
    key, eq, value = rest.partition("=")
    if not sep or not eq or not backend or not key:
        raise ValueError(f"{flag} {text!r}: expected BACKEND:KEY=VALUE")
    return backend, key, value


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _parse_baselines(ns: argparse.Namespace) -> tuple[str, ...] | None:
    if ns.no_baselines and ns.baselines is not None:
        raise ValueError("--no-baselines and --baselines contradict each other: give one")
    if ns.no_baselines:
        return ()
    return None if ns.baselines is None else _names(ns.baselines)


def _parse_rdma_devices(text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    names = text.split(",")
    if len(names) != 2 or not all(n.strip() for n in names):
        raise ValueError(
            f"--rdma-devices {text!r}: expected RECV_DEV,SEND_DEV (two RDMA device names)"
        )
    return names[0].strip(), names[1].strip()


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _transports(ns: argparse.Namespace) -> int:
    from weight_transfer.benchmarks import transport_harness as harness

    if ns.plot_path and importlib.util.find_spec("matplotlib") is None:
        print("error: --plot needs matplotlib: pip install 'matplotlib>=3.7'", file=sys.stderr)
        return 2
    try:
        if ns.sizes:
            sizes = tuple(harness.parse_size(s) for s in ns.sizes.split(",") if s.strip())
        elif ns.device == "cuda":
            sizes = harness.DEFAULT_CUDA_SIZES
        else:
            sizes = harness.DEFAULT_CPU_SIZES
        config = harness.BenchConfig(
            backends=tuple(b.strip() for b in ns.backends.split(",") if b.strip()),
            sizes_bytes=sizes,
            device=ns.device,
            warmup_rounds=ns.warmup_rounds,
            rounds=ns.rounds,
            min_sample_bytes=harness.parse_size(ns.min_sample_bytes),
            timeout_s=ns.timeout_s,
            baselines=_parse_baselines(ns),
            memcpy_threads=ns.memcpy_threads,
            options=tuple(_parse_option(o) for o in ns.option),
            receiver_options=tuple(
                _parse_option(o, "--receiver-option") for o in ns.receiver_option
            ),
            sender_options=tuple(_parse_option(o, "--sender-option") for o in ns.sender_option),
            receiver_host=ns.receiver_host,
            sender_host=ns.sender_host,
            rdma_devices=_parse_rdma_devices(ns.rdma_devices),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = (
        f"{config.sender_host} -> {config.receiver_host}"
        if config.sender_host != config.receiver_host
        else config.receiver_host
    )
    _progress(
        f"bench transports: {', '.join(config.backends)} on {config.device} ({where}), "
        f"baselines {', '.join(config.baseline_names) or 'none'}, sizes "
        f"{', '.join(harness.format_size(s) for s in config.sizes_bytes)}, "
        f"{config.rounds} rounds after {config.warmup_rounds} warm-up"
    )
    result = harness.run_benchmarks(config, progress=_progress)
    print(harness.format_table(result))
    if ns.json_path:
        harness.write_json(result, ns.json_path)
        _progress(f"wrote {ns.json_path}")
    if ns.plot_path:
        harness.plot_result(result, ns.plot_path)
        _progress(f"wrote {ns.plot_path}")
    return 1 if result.errors else 0


def _bench(ns: argparse.Namespace) -> int:
    if ns.what == "transports":
        return _transports(ns)
    if ns.what == "control-plane":
        from weight_transfer.benchmarks import bench_control_plane

        return bench_control_plane.main(ns)
    from weight_transfer.benchmarks import bench_update

    return bench_update.main(ns)


COMMANDS = (
    Command(
        "bench",
        "benchmark transports (or whole updates) side by side with baselines",
        _bench_args,
        _bench,
    ),
)
