"""One harness for transport throughput: every backend beside raw baselines, in the same run.

What is measured: one-sided write throughput from a sender process into a receiver process.
For each message size `n` a *sample* is one batch of `k` writes of `n` bytes to consecutive
offsets (`k = ceil(min_sample_bytes / n)`, so small messages are measured as a stream, like
`ucx_perftest` and `nixlbench` do), timed on the sender from `post_writes` until
`Transport.wait` returns: what a user of the transport gets (it sleeps on the batch's completion
event where the backend has one, spins on progress-driven backends, else polls with backoff).
Throughput is `k * n / seconds` in GB/s (1e9 bytes per second).

Baselines, measured in the same run with the same sizes, ops and sample counts:
- `socket`: a plain TCP stream between two processes, from the sender's address to the
  receiver's (127.0.0.1 by default); a sample is `k` `sendall` calls of `n` bytes, completed by
  a one-byte acknowledgement once the receiver holds them all.
- `memcpy`: `torch.Tensor.copy_` of the same ops in one process, on `memcpy_threads` threads
  (default 1: one copy engine, as in each backend's data path; recorded in the JSON).
- `peer_copy` (`device="cuda"`): an in-process copy GPU0 -> GPU1, timed with CUDA events.
- `ib_write_bw` (opt-in, host memory, needs `rdma_devices`): perftest's RDMA WRITE bandwidth
  from the sender's RDMA device into the receiver's, the ceiling on an RDMA host
  (`weight_transfer.benchmarks.perftest`). perftest times a run itself and prints one average,
  so each sample is one run of `max(5, k)` writes of `n` bytes; it does not check the data
  (its measurements say `verified: false`).

Two hosts: the receiver and the sender each have their own address (`receiver_host`,
`sender_host`: each side's `TransportConfig.listen_host`, the socket baseline's two ends) and
their own backend options (`receiver_options`, `sender_options`, over the shared `options`),
so one run can put the two sides on two NICs (or on the two ends of a wire within one kernel,
as the Soft-RoCE VM does). What each backend moved across which device is recorded: the bytes
every network interface and the packets every RDMA port received while it ran
(`BenchResult.wire`), so a run shows which lane carried the data (a veth or `lo`; RDMA or TCP).

Protocol per backend: the parent spawns a receiver (registers a TARGET on GPU1 or host, filled
with seeded random bytes) and a sender (registers a SOURCE on GPU0 or host, connects). For each
size the sender first writes seeded random bytes (a seed per size, different from the target's
initial seed) and the receiver checks them with `torch.equal`; only then warm-up and timed
rounds run. A mismatch fails that backend and no number is reported for it. The receiver runs
no code while samples run: it blocks on its channel. The processes are started by
`weight_transfer.cli.launch` (one pipe per child); parent and children exchange only msgpack
bytes, ints, floats and strings, and every wait has a timeout.

Used by `weight-transfer bench transports` (spawns both sides) and by `bench_transports.py`
(pytest-benchmark, sender inside the test process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from weight_transfer.backends import availability
from weight_transfer.backends.base import (
    BACKENDS,
    Region,
    RegionDescriptor,
    RegionRole,
    TransportConfig,
    TransportUnavailableError,
    WriteOp,
    create_transport,
)
from weight_transfer.benchmarks import perftest
from weight_transfer.cli.launch import Channel, Child, Launch, describe_exit, slow_host_factor

__all__ = [
    "BASELINES",
    "DEFAULT_CPU_SIZES",
    "DEFAULT_CUDA_SIZES",
    "BenchConfig",
    "BenchResult",
    "Measurement",
    "NotRunnableHere",
    "ReceiverProcess",
    "SocketReceiverProcess",
    "SocketSender",
    "WriteSampler",
    "check_targets",
    "format_size",
    "format_table",
    "memcpy_sampler",
    "parse_size",
    "peer_copy_sampler",
    "plot_result",
    "run_benchmarks",
    "sample_plan",
    "write_json",
    "seeded_bytes",
    "verify_bytes",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_CPU_SIZES: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
"""Message sizes measured by default on the host."""
DEFAULT_CUDA_SIZES: tuple[int, ...] = DEFAULT_CPU_SIZES + (256 * MiB,)
"""Message sizes measured by default GPU0 -> GPU1."""
DEFAULT_BACKENDS: tuple[str, ...] = ("loopback", "tcp", "ucx", "nixl")
"""Backends measured by default (ibverbs needs an RDMA device)."""
BASELINES: dict[str, tuple[str, ...]] = {"cpu": ("socket", "memcpy"), "cuda": ("peer_copy",)}
"""Baselines measured beside the backends by default, per device."""
KNOWN_BASELINES: dict[str, tuple[str, ...]] = {
    "cpu": ("socket", "memcpy", "ib_write_bw"),
    "cuda": ("peer_copy",),
}
"""Every baseline a run on that device may measure."""
ROLES = ("receiver", "sender")
"""The two sides of a pair, as role-scoped settings name them."""

SCHEMA = "weight-transfer/bench-transports/1"
_SOCKET_HEADER = struct.Struct("!QQQB")  # message bytes, number of messages, seed, check flag
_ACK_OK, _ACK_BAD = b"\x01", b"\x00"

# ---------------------------------------------------------------------------------------------
# Configuration and results.
# ---------------------------------------------------------------------------------------------


class NotRunnableHere(RuntimeError):
    """A backend or baseline cannot run on this host (package missing, no GPU); not a failure."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """What `run_benchmarks` measures and how."""

    backends: tuple[str, ...] = DEFAULT_BACKENDS
    """Backend names (keys of `BACKENDS`), measured in this order."""
    sizes_bytes: tuple[int, ...] = DEFAULT_CPU_SIZES
    """Message sizes, one measurement per backend and size."""
    device: str = "cpu"
    """`cpu`: host memory in both processes; `cuda`: sender on GPU0, receiver on GPU1."""
    warmup_rounds: int = 3
    """Untimed samples before the timed ones, per backend and size."""
    rounds: int = 20
    """Timed samples per backend and size; the median and p10/p90 are over these."""
    min_sample_bytes: int = 8 * MiB
    """A sample writes at least this many bytes (several messages when they are smaller)."""
    timeout_s: float = 120.0
    """Longest any single wait (a child's message, one sample) may take."""
    baselines: tuple[str, ...] | None = None
    """Baselines measured in the same run, from `KNOWN_BASELINES[device]`; () for none; None:
    `BASELINES[device]`, and `ib_write_bw` too when `rdma_devices` is set."""
    options: tuple[tuple[str, str, str], ...] = ()
    """Backend options of both sides as (backend, key, value), passed to that backend's
    TransportConfig."""
    receiver_options: tuple[tuple[str, str, str], ...] = ()
    """Options of the receiver's side only; a key given here replaces that key of `options`."""
    sender_options: tuple[tuple[str, str, str], ...] = ()
    """Options of the sender's side only; a key given here replaces that key of `options`."""
    receiver_host: str = "127.0.0.1"
    """The receiver's address: its transports' `listen_host`, the socket baseline's listener."""
    sender_host: str = "127.0.0.1"
    """The sender's address: its transports' `listen_host`, the socket baseline's source."""
    rdma_devices: tuple[str, str] | None = None
    """(receiver's, sender's) RDMA device of the `ib_write_bw` baseline."""
    memcpy_threads: int = 1
    """torch threads of the memcpy baseline (1: what one copy engine or `memcpy` does)."""
    seed: int = 20261130
    """Seed of the random bytes; each size and the targets' initial bytes derive from it."""

    def __post_init__(self) -> None:
        if self.device not in BASELINES:
            raise ValueError(f"device must be one of {sorted(BASELINES)}, got {self.device!r}")
        for name in self.backends:
            if name not in BACKENDS:
                raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends repeat a name: {list(self.backends)}")
        if not self.sizes_bytes:
            raise ValueError("sizes_bytes must name at least one size")
        for size in self.sizes_bytes:
            if size <= 0:
                raise ValueError(f"message size must be positive, got {size}")
        if self.warmup_rounds < 0:
            raise ValueError("warmup_rounds must be >= 0")
        if self.rounds < 1:
            raise ValueError("rounds must be >= 1")
        if self.min_sample_bytes < 1:
            raise ValueError("min_sample_bytes must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if self.memcpy_threads < 1:
            raise ValueError("memcpy_threads must be >= 1")
        for what, options in (
            ("option", self.options),
            ("receiver option", self.receiver_options),
            ("sender option", self.sender_options),
        ):
            for backend, key, _ in options:
                if backend not in BACKENDS:
                    raise ValueError(
                        f"{what} {key!r} names unknown backend {backend!r}; choose from "
                        f"{sorted(BACKENDS)}"
                    )
        for role in ROLES:
            host = self.host(role)
            if not host or any(c.isspace() for c in host):
                raise ValueError(f"{role}_host must be an address or host name, got {host!r}")
        if self.rdma_devices is not None and "ib_write_bw" not in KNOWN_BASELINES[self.device]:
            raise ValueError(
                f"rdma_devices are for the ib_write_bw baseline, which writes host memory; "
                f"device {self.device!r} has none"
            )
        if self.rdma_devices is not None and (
            len(self.rdma_devices) != 2 or not all(d and d.strip() == d for d in self.rdma_devices)
        ):
            raise ValueError(
                f"rdma_devices must be (receiver's device, sender's device), got "
                f"{self.rdma_devices!r}"
            )
        if self.baselines is not None:
            known = KNOWN_BASELINES[self.device]
            for name in self.baselines:
                if name not in known:
                    raise ValueError(
                        f"unknown baseline {name!r} for device {self.device}; choose from "
                        f"{list(known)}"
                    )
            if len(set(self.baselines)) != len(self.baselines):
                raise ValueError(f"baselines repeat a name: {list(self.baselines)}")
        if "ib_write_bw" in self.baseline_names and self.rdma_devices is None:
            raise ValueError(
                "the ib_write_bw baseline needs rdma_devices (the receiver's and the sender's "
                "RDMA device)"
            )
        if not self.backends and not self.baseline_names:
            raise ValueError("nothing to measure: no backends and no baselines")

    @property
    def baseline_names(self) -> tuple[str, ...]:
        """The baselines this run measures, in order."""
        if self.baselines is not None:
            return self.baselines
        default = BASELINES[self.device]
        return default + ("ib_write_bw",) if self.rdma_devices is not None else default

    def backend_options(self, backend: str, role: str) -> tuple[tuple[str, str], ...]:
        """The (key, value) options of `backend` on `role`'s side (`receiver` or `sender`):
        `options`, each key the role's own options give replaced by theirs."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        own = self.receiver_options if role == "receiver" else self.sender_options
        mine = [(k, v) for b, k, v in own if b == backend]
        replaced = {k for k, _ in mine}
        return tuple((k, v) for b, k, v in self.options if b == backend and k not in replaced) + (
            tuple(mine)
        )

    def host(self, role: str) -> str:
        """The address of `role`'s side."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.receiver_host if role == "receiver" else self.sender_host

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the source and target buffers: the largest sample."""
        return max(
            n * k for n, k in (sample_plan(s, self.min_sample_bytes) for s in self.sizes_bytes)
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """Timed samples of one backend (or baseline) at one message size."""

    name: str
    """Backend or baseline name."""
    kind: str
    """`backend` or `baseline`."""
    size_bytes: int
    """Bytes per message (write op)."""
    ops_per_sample: int
    """Messages per sample."""
    samples_s: tuple[float, ...]
    """Seconds per timed sample."""
    verified: bool = True
    """Whether the bytes were checked bit for bit before timing (not by a baseline tool)."""
    peak_gbps: tuple[float, ...] = ()
    """Per sample, the peak a tool reported beside its average (`ib_write_bw`); else empty."""
    run_wall_s: tuple[float, ...] = ()
    """Per sample, the wall time of the tool's whole run (start, connection, writes, exit),
    where a sample is a run of a tool (`ib_write_bw`); else empty."""

    @property
    def sample_bytes(self) -> int:
        """Bytes moved per sample."""
        return self.size_bytes * self.ops_per_sample

    @property
    def gbps(self) -> list[float]:
        """Throughput of every sample, GB/s (1e9 bytes/s)."""
        return [self.sample_bytes / s / 1e9 for s in self.samples_s]

    @property
    def median_gbps(self) -> float:
        """Median throughput, GB/s."""
        return percentile(self.gbps, 50)

    @property
    def p10_gbps(self) -> float:
        """10th percentile of throughput, GB/s."""
        return percentile(self.gbps, 10)

    @property
    def p90_gbps(self) -> float:
        """90th percentile of throughput, GB/s."""
        return percentile(self.gbps, 90)

    @property
    def min_gbps(self) -> float:
        """Slowest sample's throughput, GB/s."""
        return min(self.gbps)

    @property
    def max_gbps(self) -> float:
        """Fastest sample's throughput, GB/s."""
        return max(self.gbps)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the raw samples and the summary."""
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "size_bytes": self.size_bytes,
            "ops_per_sample": self.ops_per_sample,
            "sample_bytes": self.sample_bytes,
            "samples_s": list(self.samples_s),
            "median_gbps": self.median_gbps,
            "p10_gbps": self.p10_gbps,
            "p90_gbps": self.p90_gbps,
            "min_gbps": self.min_gbps,
            "max_gbps": self.max_gbps,
            "verified": self.verified,
        }
        if self.peak_gbps:
            out["peak_gbps"] = list(self.peak_gbps)
        if self.run_wall_s:
            out["run_wall_s"] = list(self.run_wall_s)
        return out


@dataclasses.dataclass(slots=True)
class BenchResult:
    """Everything one run measured, plus why anything could not be measured."""

    config: BenchConfig
    host: dict[str, Any]
    measurements: list[Measurement] = dataclasses.field(default_factory=list)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    """Backend or baseline name -> why it failed (bad data, a crash, a timeout)."""
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    """Backend or baseline name -> why it cannot run on this host."""
    wire: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """Backend or baseline name -> what each interface received while it ran (only those that
    received anything): `net:<interface>` bytes, `rdma:<device>/<port>` packets."""

    def get(self, name: str, size_bytes: int) -> Measurement | None:
        """The measurement of `name` at `size_bytes`, if any."""
        for m in self.measurements:
            if m.name == name and m.size_bytes == size_bytes:
                return m
        return None

    def ratios(self) -> list[dict[str, Any]]:
        """Each backend measurement's median divided by each baseline's median at its size."""
        rows: list[dict[str, Any]] = []
        for m in self.measurements:
            if m.kind != "backend":
                continue
            row: dict[str, Any] = {"name": m.name, "size_bytes": m.size_bytes}
            for base in self.config.baseline_names:
                b = self.get(base, m.size_bytes)
                row[f"vs_{base}"] = m.median_gbps / b.median_gbps if b is not None else None
            rows.append(row)
        return rows

    def to_json(self) -> dict[str, Any]:
        """The whole run as a JSON-ready dict."""
        cfg = dataclasses.asdict(self.config)
        for key in ("options", "receiver_options", "sender_options"):
            cfg[key] = [list(o) for o in getattr(self.config, key)]
        cfg["baselines"] = list(self.config.baseline_names)
        if self.config.rdma_devices is not None:
            cfg["rdma_devices"] = list(self.config.rdma_devices)
        return {
            "schema": SCHEMA,
            "config": cfg,
            "host": self.host,
            "measurements": [m.to_json() for m in self.measurements],
            "ratios": self.ratios(),
            "targets": check_targets(self),
            "errors": dict(self.errors),
            "skipped": dict(self.skipped),
            "wire": {name: dict(counts) for name, counts in self.wire.items()},
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def sample_plan(size_bytes: int, min_sample_bytes: int) -> tuple[int, int]:
    """(message bytes, messages per sample) for one size."""
    return size_bytes, max(1, -(-min_sample_bytes // size_bytes))


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": KiB, "m": MiB, "g": GiB}


def parse_size(text: str) -> int:
    """Parse `4KiB`, `64K`, `1MiB`, `256MiB`, `1GiB` or a plain byte count (binary units).

    Raises:
        ValueError: the text is not a positive size.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4KiB, 16MiB, 1GiB or 4096")
    unit = (match.group(2) or "")[:1].lower()
    value = int(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def format_size(nbytes: int) -> str:
    """`4KiB`, `64MiB`, ... (exact binary units when they fit, else bytes)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def seeded_bytes(nbytes: int, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """`nbytes` seeded random bytes (uint8), identical in every process; never all zeros."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.empty(-(-nbytes // 8), dtype=torch.int64).random_(generator=gen)
    return words.view(torch.uint8)[:nbytes].to(device)


def size_seed(seed: int, size_bytes: int) -> int:
    """The seed of the bytes written at message size `size_bytes`."""
    return (seed * 1_000_003 + size_bytes) % (1 << 62)


def verify_bytes(actual: torch.Tensor, seed: int) -> str:
    """`ok` if `actual` (uint8) equals `seeded_bytes(len, seed)` bit for bit, else where not."""
    expected = seeded_bytes(actual.numel(), seed)
    got = actual.cpu()
    if torch.equal(got, expected):
        return "ok"
    diff = (got != expected).nonzero()
    first = int(diff[0])
    return (
        f"mismatch: {diff.numel()} of {actual.numel()} bytes differ, first at offset {first} "
        f"(got {int(got[first])}, expected {int(expected[first])})"
    )


# ---------------------------------------------------------------------------------------------
# Backend sides.
# ---------------------------------------------------------------------------------------------


def _device_of(device: str, index: int) -> torch.device:
    return torch.device("cuda", index) if device == "cuda" else torch.device("cpu")


def _transport_config(
    backend: str, device: str, index: int, options: Sequence[tuple[str, str]], host: str
) -> TransportConfig:
    return TransportConfig(
        name=backend,
        device_index=index if device == "cuda" else None,
        listen_host=host,
        options=tuple((str(k), str(v)) for k, v in options),
    )


class WriteSampler:
    """The sender side of one backend: a connected transport, a SOURCE region and the target.

    `prepare(size)` writes that size's seeded bytes (to be verified by the receiver);
    `sample()` posts one sample's batch and waits for it, returning the seconds it took.
    """

    def __init__(
        self,
        backend: str,
        device: str,
        options: Sequence[tuple[str, str]],
        buffer_bytes: int,
        endpoint: bytes,
        descriptor: bytes,
        *,
        seed: int,
        min_sample_bytes: int,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> None:
        self.seed = seed
        self.min_sample_bytes = min_sample_bytes
        self.timeout_s = timeout_s
        self.transport = create_transport(_transport_config(backend, device, 0, options, host))
        try:
            self.source = torch.empty(buffer_bytes, dtype=torch.uint8, device=_device_of(device, 0))
            self.source.copy_(seeded_bytes(buffer_bytes, seed - 1, self.source.device))
            self.region: Region = self.transport.register(self.source, role=RegionRole.SOURCE)
            self.target = RegionDescriptor.from_bytes(descriptor)
            self.transport.connect("receiver", endpoint)
        except BaseException:
            self.transport.close()
            raise
        self.ops: list[WriteOp] = []
        self.size_bytes = 0

    def prepare(self, size_bytes: int) -> tuple[int, int]:
        """Fill the source with this size's seeded bytes, write them once, wait.

        Returns:
            (number of bytes written from offset 0, their seed), for `verify_bytes`.
        """
        size, k = sample_plan(size_bytes, self.min_sample_bytes)
        span = size * k
        seed = size_seed(self.seed, size)
        self.source[:span].copy_(seeded_bytes(span, seed, self.source.device))
        if self.source.is_cuda:
            torch.cuda.synchronize(self.source.device)
        self.size_bytes = size
        self.ops = [WriteOp(self.region, i * size, self.target, i * size, size) for i in range(k)]
        self.sample()
        return span, seed

    def sample(self) -> float:
        """Post one sample's batch and wait for it; seconds from post to completion."""
        start = time.perf_counter()
        handle = self.transport.post_writes("receiver", self.ops)
        self.transport.wait(handle, self.timeout_s)
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the transport."""
        self.transport.close()


def receiver_worker(
    backend: str,
    device: str,
    options: Sequence[tuple[str, str]],
    buffer_bytes: int,
    init_seed: int,
    timeout_s: float,
    host: str,
    channel: Channel,
) -> None:
    """Register a seeded TARGET, publish it, then answer `check` commands until `stop`.

    Runs no code while writes land: it blocks on its channel.
    """
    try:
        transport = create_transport(_transport_config(backend, device, 1, options, host))
    except TransportUnavailableError as exc:
        channel.put(("unavailable", str(exc)))
        return
    try:
        target = seeded_bytes(buffer_bytes, init_seed, _device_of(device, 1))
        region = transport.register(target, role=RegionRole.TARGET)
        assert region.descriptor is not None
        channel.put(("ready", transport.endpoint(), region.descriptor.to_bytes()))
        while True:
            cmd = channel.get(timeout_s * 4)
            if cmd[0] == "stop":
                break
            _, span, seed = cmd
            if target.is_cuda:
                torch.cuda.synchronize(target.device)
            channel.put(("checked", verify_bytes(target[:span], seed)))
    finally:
        transport.close()


def sender_worker(
    backend: str,
    device: str,
    options: Sequence[tuple[str, str]],
    buffer_bytes: int,
    endpoint: bytes,
    descriptor: bytes,
    sizes_bytes: Sequence[int],
    warmup_rounds: int,
    rounds: int,
    seed: int,
    min_sample_bytes: int,
    timeout_s: float,
    host: str,
    channel: Channel,
) -> None:
    """Per size: write seeded bytes, let the parent verify them, then time the samples."""
    sampler = WriteSampler(
        backend, device, options, buffer_bytes, endpoint, descriptor,
        seed=seed, min_sample_bytes=min_sample_bytes, timeout_s=timeout_s, host=host,
    )  # fmt: skip
    try:
        for size in sizes_bytes:
            span, size_seed_ = sampler.prepare(size)
            channel.put(("written", size, span, size_seed_))
            if channel.get(timeout_s)[0] != "go":
                break
            for _ in range(warmup_rounds):
                sampler.sample()
            samples = [sampler.sample() for _ in range(rounds)]
            channel.put(("samples", size, len(sampler.ops), samples))
    finally:
        sampler.close()
    channel.put(("done",))


def _stop(launch: Launch, timeout_s: float) -> list[str]:
    """Wait up to `timeout_s` for the launch's children to exit (killing the rest); return
    one line per child that did not exit with 0."""
    codes = launch.close(grace_s=timeout_s)
    return [
        f"{name} did not exit in time; killed"
        if name in launch.killed
        else f"{name} exited with {describe_exit(code)}"
        for name, code in codes.items()
        if code != 0 or name in launch.killed
    ]


class ReceiverProcess:
    """A spawned `receiver_worker` and its channel; a context manager that stops and joins it."""

    def __init__(
        self,
        backend: str,
        device: str,
        options: Sequence[tuple[str, str]],
        buffer_bytes: int,
        init_seed: int,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> None:
        self.timeout_s = timeout_s
        self.name = f"{backend} receiver"
        self._launch = Launch(
            [
                Child(
                    self.name,
                    receiver_worker,
                    (backend, device, list(options), buffer_bytes, init_seed, timeout_s, host),
                )
            ]
        ).start()
        try:
            msg = self._launch.recv(self.name, timeout_s)
        except BaseException:
            self.stop()
            raise
        if msg[0] == "unavailable":
            self.stop()
            raise NotRunnableHere(msg[1])
        self.endpoint: bytes = msg[1]
        self.descriptor: bytes = msg[2]

    def check(self, span: int, seed: int) -> str:
        """The receiver's verdict on its first `span` bytes against `seeded_bytes(span, seed)`."""
        self._launch.send(self.name, ("check", span, seed))
        verdict: str = self._launch.recv(self.name, self.timeout_s)[1]
        return verdict

    def stop(self) -> list[str]:
        """Stop and join the process; return exit problems (empty when it exited with 0)."""
        if self._launch.exit_code(self.name) is None:
            with contextlib.suppress(OSError):  # it may have died: the exit code says so
                self._launch.send(self.name, ("stop",))
        return _stop(self._launch, self.timeout_s)

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _measure_backend(
    config: BenchConfig, backend: str, progress: Callable[[str], None]
) -> list[Measurement]:
    buffer_bytes = config.buffer_bytes
    out: list[Measurement] = []
    with ReceiverProcess(
        backend, config.device, config.backend_options(backend, "receiver"), buffer_bytes,
        config.seed + 1, config.timeout_s, config.receiver_host,
    ) as receiver:  # fmt: skip
        name = f"{backend} sender"
        sender = Launch(
            [
                Child(
                    name,
                    sender_worker,
                    (
                        backend,
                        config.device,
                        list(config.backend_options(backend, "sender")),
                        buffer_bytes,
                        receiver.endpoint,
                        receiver.descriptor,
                        list(config.sizes_bytes),
                        config.warmup_rounds,
                        config.rounds,
                        config.seed,
                        config.min_sample_bytes,
                        config.timeout_s,
                        config.sender_host,
                    ),
                )  # fmt: skip
            ]
        ).start()
        try:
            for _ in config.sizes_bytes:
                _, size, span, seed = sender.recv(name, config.timeout_s)
                verdict = receiver.check(span, seed)
                if verdict != "ok":
                    sender.send(name, ("abort",))
                    raise RuntimeError(
                        f"{backend}: data check failed at {format_size(size)} messages: {verdict}"
                    )
                sender.send(name, ("go",))
                timeout = config.timeout_s * (config.rounds + config.warmup_rounds + 1)
                _, size, k, samples = sender.recv(name, timeout)
                m = Measurement(backend, "backend", size, k, tuple(samples))
                progress(_progress_line(config, m))
                out.append(m)
            sender.recv(name, config.timeout_s)  # "done"
        finally:
            bad = _stop(sender, config.timeout_s)
            bad += receiver.stop()
        if bad:
            raise RuntimeError(f"{backend}: " + "; ".join(bad))
    return out


# ---------------------------------------------------------------------------------------------
# Baselines.
# ---------------------------------------------------------------------------------------------


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while view:
        got = conn.recv_into(view)
        if got == 0:
            raise ConnectionError("socket baseline: sender closed the stream")
        view = view[got:]


def socket_receiver_worker(
    buffer_bytes: int, timeout_s: float, host: str, channel: Channel
) -> None:
    """Listen on `host`; per sample receive the header, then the bytes, then acknowledge.

    A sample with its check flag set is verified against its seed and acknowledged with
    `_ACK_BAD` on a mismatch. A header with zero messages ends the stream.
    """
    raw = bytearray(buffer_bytes)
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    view = memoryview(raw)
    with socket.create_server((host, 0)) as server:
        server.settimeout(timeout_s)
        channel.put(("ready", server.getsockname()[1]))
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(_SOCKET_HEADER.size)
        while True:
            _recv_exact(conn, memoryview(header))
            size, k, seed, check = _SOCKET_HEADER.unpack(header)
            if k == 0:
                break
            span = size * k
            if span > buffer_bytes:
                raise ValueError(f"socket baseline: sample of {span} bytes exceeds the buffer")
            _recv_exact(conn, view[:span])
            ok = not check or verify_bytes(buf[:span], seed) == "ok"
            conn.sendall(_ACK_OK if ok else _ACK_BAD)
    channel.put(("done",))


class SocketReceiverProcess:
    """A spawned `socket_receiver_worker`; a context manager that joins it."""

    def __init__(self, buffer_bytes: int, timeout_s: float, host: str = "127.0.0.1") -> None:
        self.timeout_s = timeout_s
        self.host = host
        self.name = "socket receiver"
        self._launch = Launch(
            [Child(self.name, socket_receiver_worker, (buffer_bytes, timeout_s, host))]
        ).start()
        try:
            self.port: int = self._launch.recv(self.name, timeout_s)[1]
        except BaseException:
            _stop(self._launch, 1.0)
            raise

    def done(self) -> None:
        """Wait for the receiver's report that the stream ended."""
        self._launch.recv(self.name, self.timeout_s)

    def join(self) -> list[str]:
        """Join the process; return exit problems."""
        return _stop(self._launch, self.timeout_s)

    def __enter__(self) -> SocketReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.join()


class SocketSender:
    """The sending end of the socket baseline: `k` `sendall`s of `n` bytes per sample.

    It connects to `host` from `source_host` (bound, so that between two addresses of one
    kernel the stream takes the route between them rather than `lo`).
    """

    def __init__(self, port: int, buffer_bytes: int, *, seed: int, min_sample_bytes: int,
                 timeout_s: float, host: str = "127.0.0.1",
                 source_host: str = "127.0.0.1") -> None:  # fmt: skip
        self.seed = seed
        self.min_sample_bytes = min_sample_bytes
        raw = bytearray(buffer_bytes)
        self.buf = torch.frombuffer(raw, dtype=torch.uint8)
        self.view = memoryview(raw)
        try:
            self.conn = socket.create_connection(
                (host, port), timeout=timeout_s, source_address=(source_host, 0)
            )
        except OSError as exc:
            raise OSError(
                f"socket baseline: cannot connect from {source_host} to {host}:{port}: {exc}"
            ) from exc
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.size_bytes = 0
        self.k = 0
        self.ack = bytearray(1)

    def prepare(self, size_bytes: int) -> None:
        """Send this size's seeded bytes once with the check flag.

        Raises:
            RuntimeError: the receiver found different bytes.
        """
        self.size_bytes, self.k = sample_plan(size_bytes, self.min_sample_bytes)
        span = self.size_bytes * self.k
        seed = size_seed(self.seed, self.size_bytes)
        self.buf[:span].copy_(seeded_bytes(span, seed))
        if self._send(seed, check=True) != _ACK_OK:
            raise RuntimeError(f"socket baseline: data check failed at {format_size(size_bytes)}")

    def _send(self, seed: int, *, check: bool) -> bytes:
        n = self.size_bytes
        self.conn.sendall(_SOCKET_HEADER.pack(n, self.k, seed, int(check)))
        for i in range(self.k):
            self.conn.sendall(self.view[i * n : (i + 1) * n])
        _recv_exact(self.conn, memoryview(self.ack))
        return bytes(self.ack)

    def sample(self) -> float:
        """One sample: seconds from the first byte sent until the acknowledgement arrived."""
        start = time.perf_counter()
        self._send(0, check=False)
        return time.perf_counter() - start

    def close(self) -> None:
        """End the stream (a header with zero messages) and close the socket."""
        with contextlib.suppress(OSError):
            self.conn.sendall(_SOCKET_HEADER.pack(0, 0, 0, 0))
        self.conn.close()


def socket_sender_worker(
    port: int,
    buffer_bytes: int,
    sizes_bytes: Sequence[int],
    warmup_rounds: int,
    rounds: int,
    seed: int,
    min_sample_bytes: int,
    timeout_s: float,
    host: str,
    source_host: str,
    channel: Channel,
) -> None:
    """The socket baseline's sender as a process: per size check, warm up, time."""
    sender = SocketSender(port, buffer_bytes, seed=seed, min_sample_bytes=min_sample_bytes,
                          timeout_s=timeout_s, host=host, source_host=source_host)  # fmt: skip
    try:
        for size in sizes_bytes:
            sender.prepare(size)
            for _ in range(warmup_rounds):
                sender.sample()
            samples = [sender.sample() for _ in range(rounds)]
            channel.put(("samples", size, sender.k, samples))
    finally:
        sender.close()
    channel.put(("done",))


def _measure_socket(config: BenchConfig, progress: Callable[[str], None]) -> list[Measurement]:
    out: list[Measurement] = []
    with SocketReceiverProcess(
        config.buffer_bytes, config.timeout_s, config.receiver_host
    ) as receiver:
        name = "socket sender"
        sender = Launch(
            [
                Child(
                    name,
                    socket_sender_worker,
                    (
                        receiver.port,
                        config.buffer_bytes,
                        list(config.sizes_bytes),
                        config.warmup_rounds,
                        config.rounds,
                        config.seed,
                        config.min_sample_bytes,
                        config.timeout_s,
                        config.receiver_host,
                        config.sender_host,
                    ),
                )  # fmt: skip
            ]
        ).start()
        try:
            timeout = config.timeout_s * (config.rounds + config.warmup_rounds + 1)
            for _ in config.sizes_bytes:
                _, size, k, samples = sender.recv(name, timeout)
                m = Measurement("socket", "baseline", size, k, tuple(samples))
                progress(_progress_line(config, m))
                out.append(m)
            sender.recv(name, config.timeout_s)  # "done"
            receiver.done()
        finally:
            bad = _stop(sender, config.timeout_s) + receiver.join()
        if bad:
            raise RuntimeError("socket baseline: " + "; ".join(bad))
    return out


def memcpy_sampler(
    size_bytes: int, min_sample_bytes: int, seed: int, buffers: tuple[torch.Tensor, torch.Tensor]
) -> Callable[[], float]:
    """Check one sample's copies bit for bit, then return a function timing one sample.

    `buffers` are (source, destination) host uint8 tensors of at least one sample's bytes.
    """
    src, dst = buffers
    n, k = sample_plan(size_bytes, min_sample_bytes)
    span = n * k
    seed_ = size_seed(seed, n)
    src[:span].copy_(seeded_bytes(span, seed_))
    pairs = [(dst[i * n : (i + 1) * n], src[i * n : (i + 1) * n]) for i in range(k)]

    def sample() -> float:
        start = time.perf_counter()
        for d, s in pairs:
            d.copy_(s)
        return time.perf_counter() - start

    sample()
    verdict = verify_bytes(dst[:span], seed_)
    if verdict != "ok":
        raise RuntimeError(f"memcpy baseline: data check failed: {verdict}")
    return sample


def peer_copy_sampler(
    size_bytes: int, min_sample_bytes: int, seed: int, buffers: tuple[torch.Tensor, torch.Tensor]
) -> Callable[[], float]:
    """Like `memcpy_sampler` for (GPU0 source, GPU1 destination), timed with CUDA events."""
    src, dst = buffers
    n, k = sample_plan(size_bytes, min_sample_bytes)
    span = n * k
    seed_ = size_seed(seed, n)
    src[:span].copy_(seeded_bytes(span, seed_, src.device))
    pairs = [(dst[i * n : (i + 1) * n], src[i * n : (i + 1) * n]) for i in range(k)]
    stream = torch.cuda.current_stream(src.device)

    def sample() -> float:
        with torch.cuda.device(src.device):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            end.record(stream)
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

    sample()
    torch.cuda.synchronize(dst.device)
    verdict = verify_bytes(dst[:span], seed_)
    if verdict != "ok":
        raise RuntimeError(f"peer-copy baseline: data check failed: {verdict}")
    return sample


def _measure_in_process(
    config: BenchConfig,
    name: str,
    make: Callable[[int, int, int, tuple[torch.Tensor, torch.Tensor]], Callable[[], float]],
    buffers: tuple[torch.Tensor, torch.Tensor],
    progress: Callable[[str], None],
) -> list[Measurement]:
    out = []
    for size in config.sizes_bytes:
        sample = make(size, config.min_sample_bytes, config.seed, buffers)
        for _ in range(config.warmup_rounds):
            sample()
        samples = tuple(sample() for _ in range(config.rounds))
        _, k = sample_plan(size, config.min_sample_bytes)
        m = Measurement(name, "baseline", size, k, samples)
        progress(_progress_line(config, m))
        out.append(m)
    return out


def _measure_baseline(
    config: BenchConfig, name: str, progress: Callable[[str], None]
) -> list[Measurement]:
    nbytes = config.buffer_bytes
    if name == "socket":
        return _measure_socket(config, progress)
    if name == "memcpy":
        host = (torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8))
        threads = torch.get_num_threads()
        torch.set_num_threads(config.memcpy_threads)
        try:
            return _measure_in_process(config, name, memcpy_sampler, host, progress)
        finally:
            torch.set_num_threads(threads)
    if name == "peer_copy":
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if num_gpus < 2:
            raise NotRunnableHere(f"peer copy needs 2 CUDA GPUs, this host has {num_gpus}")
        gpu = (
            torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"),
            torch.empty(nbytes, dtype=torch.uint8, device="cuda:1"),
        )
        return _measure_in_process(config, name, peer_copy_sampler, gpu, progress)
    if name == "ib_write_bw":
        return _measure_ib_write_bw(config, progress)
    raise ValueError(f"unknown baseline {name!r}")


def _measure_ib_write_bw(config: BenchConfig, progress: Callable[[str], None]) -> list[Measurement]:
    """perftest's `ib_write_bw` between the two RDMA devices: per size, `warmup_rounds` runs
    untimed, then one sample per run (its own average; see `weight_transfer.benchmarks.perftest`).
    """
    assert config.rdma_devices is not None  # BenchConfig requires them for this baseline
    reason = perftest.unavailable_reason(config.rdma_devices)
    if reason is not None:
        raise NotRunnableHere(reason)
    server, client = (
        perftest.RdmaSide(
            device=device,
            gid_index=perftest.roce_gid_index(device, address=config.host(role)),
            host=config.host(role),
        )
        for device, role in zip(config.rdma_devices, ROLES, strict=True)
    )
    # A process of its own per run, like the launcher's children: slow hosts get longer.
    timeout_s = config.timeout_s * slow_host_factor()
    out: list[Measurement] = []
    for size in config.sizes_bytes:
        iterations = perftest.ib_write_bw_iterations(size, config.min_sample_bytes)
        runs = [
            perftest.run_ib_write_bw(
                server=server,
                client=client,
                size_bytes=size,
                iterations=iterations,
                timeout_s=timeout_s,
            )
            for _ in range(config.warmup_rounds + config.rounds)
        ][config.warmup_rounds :]
        m = Measurement(
            "ib_write_bw",
            "baseline",
            size,
            iterations,
            tuple(size * iterations / r.report.average_bytes_per_s for r in runs),
            verified=False,
            peak_gbps=tuple(r.report.peak_bytes_per_s / 1e9 for r in runs),
            run_wall_s=tuple(r.wall_s for r in runs),
        )
        progress(_progress_line(config, m))
        out.append(m)
    return out


def wire_counters(
    net: Path = Path("/sys/class/net"), rdma: Path = perftest.RDMA_SYSFS
) -> dict[str, int]:
    """What every network interface (`net:<name>`, bytes) and every RDMA port
    (`rdma:<device>/<port>`, packets; ports that count them, as rxe does) received so far."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for dev in net.iterdir():
            with contextlib.suppress(OSError, ValueError):
                counts[f"net:{dev.name}"] = int((dev / "statistics" / "rx_bytes").read_text())
    with contextlib.suppress(OSError):
        for dev in rdma.iterdir():
            with contextlib.suppress(OSError):
                for port in (dev / "ports").iterdir():
                    with contextlib.suppress(OSError, ValueError):
                        packets = (port / "hw_counters" / "rcvd_pkts").read_text()
                        counts[f"rdma:{dev.name}/{port.name}"] = int(packets)
    return counts


def wire_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that grew from `before` to `after`, by how much."""
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v > before.get(k, 0)}


# ---------------------------------------------------------------------------------------------
# Orchestration and reports.
# ---------------------------------------------------------------------------------------------


def _package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_info() -> dict[str, Any]:
    """Hardware and versions, for the JSON and the results files."""
    cuda = torch.cuda.is_available()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "packages": {d: _package_version(d) for d in ("libucx-cu13", "nixl-cu13", "msgpack")},
        "rdma_devices": availability.rdma_devices(),
        "loadavg": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _progress_line(config: BenchConfig, m: Measurement) -> str:
    return (
        f"[{config.device}] {m.name:<10} {format_size(m.size_bytes):>7} x{m.ops_per_sample:<5} "
        f"median {m.median_gbps:8.3f} GB/s  p10-p90 {m.p10_gbps:.3f}-{m.p90_gbps:.3f}"
    )


def run_benchmarks(
    config: BenchConfig, progress: Callable[[str], None] = lambda _line: None
) -> BenchResult:
    """Measure the baselines, then every backend; a backend that fails is recorded, not fatal.

    Args:
        progress: called with one line per finished measurement (and per failure).
    """
    result = BenchResult(config=config, host=host_info())
    if "ib_write_bw" in config.baseline_names:
        result.host["perftest"] = perftest.version()
    names = [(b, True) for b in config.baseline_names]
    names += [(b, False) for b in config.backends]
    for name, is_baseline in names:
        before = wire_counters()
        try:
            if is_baseline:
                result.measurements += _measure_baseline(config, name, progress)
            else:
                result.measurements += _measure_backend(config, name, progress)
        except NotRunnableHere as exc:
            result.skipped[name] = str(exc)
            progress(f"[{config.device}] {name}: cannot run here: {exc}")
        except (RuntimeError, OSError, ValueError, TimeoutError) as exc:
            # One backend failing (not installed, no GPU, bad data) must not hide the others.
            result.errors[name] = str(exc).strip()
            progress(f"[{config.device}] {name}: FAILED: {str(exc).strip().splitlines()[-1]}")
        received = wire_delta(before, wire_counters())
        if received:
            result.wire[name] = received
    result.host["loadavg_end"] = list(os.getloadavg())
    return result


# Targets from the project's issue: (device, size, backend, baseline, minimum ratio).
TARGETS: tuple[tuple[str, int, str, str, float], ...] = (
    ("cpu", 64 * MiB, "ucx", "socket", 2.0),
    ("cpu", 64 * MiB, "ucx", "memcpy", 0.5),
    ("cpu", 64 * MiB, "nixl", "socket", 2.0),
    ("cpu", 64 * MiB, "nixl", "memcpy", 0.5),
    ("cpu", 64 * MiB, "tcp", "socket", 0.8),
    ("cuda", 256 * MiB, "loopback", "peer_copy", 0.9),
    ("cuda", 256 * MiB, "ucx", "peer_copy", 0.9),
    ("cuda", 256 * MiB, "nixl", "peer_copy", 0.9),
)
"""Throughput ratios the transports should reach."""


def check_targets(result: BenchResult) -> list[dict[str, Any]]:
    """Each target of `TARGETS` that this run's device covers, with its measured ratio."""
    rows = []
    for device, size, backend, baseline, minimum in TARGETS:
        if device != result.config.device or size not in result.config.sizes_bytes:
            continue
        m = result.get(backend, size)
        b = result.get(baseline, size)
        ratio = m.median_gbps / b.median_gbps if m is not None and b is not None else None
        rows.append(
            {
                "backend": backend,
                "baseline": baseline,
                "size_bytes": size,
                "minimum_ratio": minimum,
                "ratio": ratio,
                "met": None if ratio is None else ratio >= minimum,
            }
        )
    return rows


def format_table(result: BenchResult) -> str:
    """A fixed-width table: every measurement, its spread and its ratios to the baselines."""
    bases = result.config.baseline_names
    head = ["name", "size", "ops/sample", "median GB/s", "p10-p90 GB/s", "min-max GB/s"]
    head += [f"vs {b}" for b in bases]
    rows = [head]
    for m in sorted(
        result.measurements, key=lambda m: (m.kind != "baseline", m.name, m.size_bytes)
    ):
        row = [
            m.name,
            format_size(m.size_bytes),
            str(m.ops_per_sample),
            f"{m.median_gbps:.3f}",
            f"{m.p10_gbps:.3f}-{m.p90_gbps:.3f}",
            f"{m.min_gbps:.3f}-{m.max_gbps:.3f}",
        ]
        for base in bases:
            b = result.get(base, m.size_bytes)
            row.append(f"{m.median_gbps / b.median_gbps:.2f}x" if b is not None else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    targets = check_targets(result)
    if targets:
        lines.append("")
        lines.append("targets:")
        for t in targets:
            got = "not measured" if t["ratio"] is None else f"{t['ratio']:.2f}x"
            verdict = {None: "n/a", True: "met", False: "NOT met"}[t["met"]]
            lines.append(
                f"  {t['backend']:<9} at {format_size(t['size_bytes'])}: >= {t['minimum_ratio']}x "
                f"{t['baseline']}: {got} ({verdict})"
            )
    if any(not m.verified for m in result.measurements):
        unchecked = sorted({m.name for m in result.measurements if not m.verified})
        lines.append("")
        lines.append(
            f"not checked bit for bit (a tool's own figures, one run per sample): "
            f"{', '.join(unchecked)}"
        )
    if result.wire:
        lines.append("")
        lines.append("received while each ran (bytes per interface, packets per RDMA port):")
        for name, counts in result.wire.items():
            got = ", ".join(f"{k} {_count(k, v)}" for k, v in counts.items())
            lines.append(f"  {name:<11} {got}")
    for name, why in result.skipped.items():
        lines.append(f"{name}: cannot run here: {why}")
    for name, why in result.errors.items():
        lines.append(f"{name}: FAILED: {why.splitlines()[-1] if why else ''}")
    return "\n".join(lines)


def _count(key: str, value: int) -> str:
    if key.startswith("rdma:"):
        return f"{value} pkts"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} B"


def write_json(result: BenchResult, path: str | Path) -> None:
    """Write `result.to_json()` to `path`."""
    Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n")


LOG_AXIS_SPAN = 10.0
"""Plot throughput on a log axis once its values span more than this factor: on a linear one
the slower lines (a transport beside a memcpy baseline 50x faster) lie flat at the bottom."""


def throughput_axis_scale(values: Sequence[float]) -> str:
    """ "log" when the positive `values` span more than `LOG_AXIS_SPAN`, else "linear"."""
    positive = [v for v in values if v > 0]
    if positive and max(positive) > LOG_AXIS_SPAN * min(positive):
        return "log"
    return "linear"


def plot_result(result: BenchResult, path: str | Path) -> None:
    """Throughput against message size (log2 x axis): a line per backend, dashed baselines; the
    y axis is logarithmic when the lines span more than `LOG_AXIS_SPAN`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    names = dict.fromkeys(m.name for m in result.measurements)
    for name in names:
        ms = sorted((m for m in result.measurements if m.name == name), key=lambda m: m.size_bytes)
        xs = [m.size_bytes for m in ms]
        baseline = ms[0].kind == "baseline"
        (line,) = ax.plot(
            xs,
            [m.median_gbps for m in ms],
            linestyle="--" if baseline else "-",
            marker="" if baseline else "o",
            label=f"{name} (baseline)" if baseline else name,
        )
        if not baseline:
            lo, hi = [m.p10_gbps for m in ms], [m.p90_gbps for m in ms]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    sizes = sorted({m.size_bytes for m in result.measurements})
    ax.set_xscale("log", base=2)
    scale = throughput_axis_scale(
        [v for m in result.measurements for v in (m.median_gbps, m.p10_gbps, m.p90_gbps)]
    )
    ax.set_yscale(scale)
    if sizes:
        ax.set_xticks(sizes, [format_size(s) for s in sizes])
    ax.set_xlabel("message size")
    ax.set_ylabel(
        f"throughput, GB/s (median; band p10-p90){', log scale' if scale == 'log' else ''}"
    )
    cfg = result.config
    if cfg.device == "cuda":
        where = "GPU0 -> GPU1"
    elif cfg.sender_host == cfg.receiver_host:
        where = f"host, {cfg.receiver_host}"
    else:
        where = f"host, {cfg.sender_host} -> {cfg.receiver_host}"
    ax.set_title(f"one-sided write throughput ({where}, {result.host.get('hostname', '')})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def backend_pair(
    config: BenchConfig, backend: str
) -> Iterator[tuple[ReceiverProcess, WriteSampler]]:
    """A receiver process and an in-process sender of `backend` (for pytest-benchmark)."""
    with ReceiverProcess(
        backend, config.device, config.backend_options(backend, "receiver"), config.buffer_bytes,
        config.seed + 1, config.timeout_s, config.receiver_host,
    ) as receiver:  # fmt: skip
        sampler = WriteSampler(
            backend, config.device, config.backend_options(backend, "sender"),
            config.buffer_bytes, receiver.endpoint, receiver.descriptor, seed=config.seed,
            min_sample_bytes=config.min_sample_bytes, timeout_s=config.timeout_s,
            host=config.sender_host,
        )  # fmt: skip
        try:
            yield receiver, sampler
        finally:
            sampler.close()
        problems = receiver.stop()
        if problems:
            raise RuntimeError(f"{backend} receiver: " + "; ".join(problems))
