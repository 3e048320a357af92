"""Helpers and spawn-able worker functions for the conformance suite.

Workers are module-level (spawn pickles them by name), started by `weight_transfer.cli.launch`,
and talk to the parent only through their launcher channel (msgpack: bytes, ints, strings and
lists of them). A worker reports "ok" or a mismatch and exits non-zero on failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Sequence

import torch

from tests.markers import softroce_hosts
from weight_transfer.backends import availability
from weight_transfer.backends.base import (
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportConfig,
    WriteOp,
    create_transport,
)
from weight_transfer.cli.launch import Channel, Child, Launch, describe_exit


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One configuration the suite runs: a backend and its options."""

    backend: str
    options: tuple[tuple[str, str], ...] = ()
    rdma: bool = False
    """It runs over verbs: it needs an RDMA device and carries the `rdma` marker."""
    device_option: str | None = None
    """The option that names the RDMA device's port for it (`rdma_device`), if any."""
    first_write_needs_target: str | None = None
    """Why its first write after `connect` needs the target's CPU (the stopped-target test is
    skipped with this reason), if it does."""

    @property
    def ucx_library(self) -> str | None:
        """The UCX build its backend loads through our binding (`library`), None if not ucx."""
        return dict(self.options).get("library", "auto") if self.backend == "ucx" else None


CASES: dict[str, Case] = {
    "loopback": Case("loopback"),
    "tcp": Case("tcp"),
    "ucx": Case("ucx"),
    # The distribution's UCX (Debian 12: 1.13) over its tcp lane on lo: the build that does
    # verbs on an RDMA host, run here where there is none.
    "ucx-system": Case("ucx", (("library", "system"), ("TLS", "tcp"))),
    "nixl": Case("nixl"),
    "ibverbs": Case("ibverbs", rdma=True),
    # Over verbs (rc). rc_verbs alone cannot connect: UCP sends its wireup over ud. A target
    # progresses from its construction, as connect waits for rc's wireup, which the target
    # answers (in-process pairs connect before registering).
    # UCX before 1.19 cannot receive ud from IPv4 GIDs on non-Mellanox devices: the port's
    # IPv6 GID (rxe: 0, its link-local address) for Debian's 1.13 (`_tls.UD_GRH_FIX_SINCE`).
    "ucx-system-rc": Case(
        "ucx",
        (
            ("library", "system"),
            ("TLS", "rc_verbs,ud_verbs"),
            ("IB_GID_INDEX", "0"),
            ("target_progress", "on"),
        ),
        rdma=True,
        device_option="NET_DEVICES",
    ),
    "ucx-nixl-rc": Case(
        "ucx",
        (("library", "nixl"), ("TLS", "rc_verbs,ud_verbs"), ("target_progress", "on")),
        rdma=True,
        device_option="NET_DEVICES",
    ),
    # NIXL also connects its agent to itself at start: it needs the self lane.
    "nixl-rc": Case(
        "nixl",
        (("UCX_TLS", "rc_verbs,ud_verbs,self"),),
        rdma=True,
        device_option="ucx_devices",
        first_write_needs_target=(
            "NIXL 1.5.1 wires its UCX rc endpoint during the first transfer (its connect only "
            "records the peer), and UCP's wireup needs the target to answer: a first write into "
            "a stopped target fails (NIXL_ERR_REMOTE_DISCONNECT in the Soft-RoCE VM); later "
            "writes are one-sided. The ucx backend wires at connect (ucx-*-rc run this test)"
        ),
    ),
}
"""Every configuration the suite runs, by test id; one that cannot run here is skipped with its
reason. A plain backend name is the backend with its defaults."""

BACKEND_NAMES: list[str] = list(CASES)
"""The suite's case ids (`CASES`), in order."""


def case(name: str) -> Case:
    """The case `name` (a backend name alone is that backend with its defaults)."""
    return CASES.get(name) or Case(name)


def backend_of(name: str) -> str:
    """The backend a case runs (`ucx` for `ucx-system-rc`)."""
    return case(name).backend


def rdma_device() -> str | None:
    """The RDMA device the verbs cases use: the Soft-RoCE VM's first host's, else the first
    the kernel lists (None without one)."""
    hosts = softroce_hosts()
    if hosts is not None:
        return hosts[0].device
    devices = availability.rdma_devices()
    return devices[0] if devices else None


def case_config(name: str) -> TransportConfig:
    """The transport config of case `name` (its RDMA device filled in for this host)."""
    c = case(name)
    options = c.options
    if c.device_option is not None:
        device = rdma_device()
        if device is not None:
            options = options + ((c.device_option, f"{device}:1"),)
    return TransportConfig(name=c.backend, options=options)


QUEUE_TIMEOUT_S = 60.0
"""How long the parent waits for any message from a child."""

# Sizes of the ops a sender splits a range into, cycled: odd on purpose, 1 byte to 1 MiB + 3.
ODD_SIZES = (1, 3, 4093, 7, 65537, 2, 1048579, 129)


def seeded_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` seeded random bytes (uint8); never zeros, so a wrong offset shows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def make_transport(name: str) -> Transport:
    """A transport of case `name` (`CASES`; a plain backend name: its defaults)."""
    return create_transport(case_config(name))


def split_odd(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """Split [offset, offset+nbytes) into (relative offset, size) pieces of ODD_SIZES."""
    pieces: list[tuple[int, int]] = []
    pos = 0
    i = 0
    while pos < nbytes:
        size = min(ODD_SIZES[i % len(ODD_SIZES)], nbytes - pos)
        pieces.append((pos, size))
        pos += size
        i += 1
    return pieces


def expected_after(nbytes: int, init_seed: int, plan: Sequence[Sequence[int]]) -> torch.Tensor:
    """The target's bytes after every (offset, length, seed) range of `plan` was written."""
    expected = seeded_bytes(nbytes, init_seed)
    for offset, length, seed in plan:
        expected[offset : offset + length] = seeded_bytes(length, seed)
    return expected


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two equal-length byte tensors first differ, for failure messages."""
    diff = (a != b).nonzero()
    if diff.numel() == 0:
        return "equal"
    i = int(diff[0])
    return f"{diff.numel()} byte(s) differ, first at {i}: {int(a[i])} != {int(b[i])}"


# ---------------------------------------------------------------------------------------------
# Workers (run in spawned processes, started by `weight_transfer.cli.launch`).
# ---------------------------------------------------------------------------------------------


def receiver_worker(backend: str, nbytes: int, init_seed: int, channel: Channel) -> None:
    """Register a seeded TARGET, publish it, then check it against the plans the parent sends
    (one verdict per plan; an empty message ends it).

    Runs no code while the writes happen: it blocks on its channel.
    """
    transport = make_transport(backend)
    try:
        target = seeded_bytes(nbytes, init_seed)
        region = transport.register(target, role=RegionRole.TARGET)
        assert region.descriptor is not None
        channel.put(("ready", transport.endpoint(), region.descriptor.to_bytes()))
        while (plan := channel.get(QUEUE_TIMEOUT_S * 3)) is not None:
            verdict = first_difference(target, expected_after(nbytes, init_seed, plan))
            channel.put("ok" if verdict == "equal" else f"mismatch: {verdict}")
            if verdict != "equal":
                raise SystemExit(1)
    finally:
        transport.close()


def sender_worker(
    backend: str,
    endpoint: bytes,
    descriptor: bytes,
    plan: list[list[int]],
    wait_for_go: bool,
    channel: Channel,
) -> None:
    """Write each (offset, length, seed) range of `plan` in odd-sized ops, two batches per range.

    With `wait_for_go`, report "connected" once connected and write only after the parent
    answers "go" (so the parent can stop the target between the two).
    """
    transport = make_transport(backend)
    try:
        desc = RegionDescriptor.from_bytes(descriptor)
        transport.connect("receiver", endpoint)
        if wait_for_go:
            channel.put("connected")
            go = channel.get(QUEUE_TIMEOUT_S)
            assert go == "go", go
        handles = []
        sources = []
        for offset, length, seed in plan:
            data = seeded_bytes(length, seed)
            sources.append(data)  # the source must stay alive until its writes complete
            src = transport.register(data, role=RegionRole.SOURCE)
            ops = [
                WriteOp(src, rel, desc, offset + rel, size)
                for rel, size in split_odd(offset, length)
            ]
            half = len(ops) // 2
            for batch in (ops[:half], ops[half:]):
                if batch:
                    handles.append(transport.post_writes("receiver", batch))
        for handle in handles:
            transport.wait(handle, timeout_s=QUEUE_TIMEOUT_S)
    finally:
        transport.close()
    channel.put("ok")


# ---------------------------------------------------------------------------------------------
# Parent-side orchestration.
# ---------------------------------------------------------------------------------------------


class Receiver:
    """A receiver_worker process and its channel."""

    NAME = "conformance-receiver"

    def __init__(self, backend: str, nbytes: int, init_seed: int) -> None:
        self.nbytes = nbytes
        self.init_seed = init_seed
        self._launch = Launch([Child(self.NAME, receiver_worker, (backend, nbytes, init_seed))])
        self._launch.start()
        msg = self._launch.recv(self.NAME, QUEUE_TIMEOUT_S)
        assert msg[0] == "ready", msg
        self.endpoint: bytes = msg[1]
        self.descriptor: bytes = msg[2]

    def check(self, plan: Sequence[Sequence[int]]) -> str:
        """Ask the receiver to compare its memory with `plan`; return its verdict."""
        self._launch.send(self.NAME, [list(p) for p in plan])
        verdict: str = self._launch.recv(self.NAME, QUEUE_TIMEOUT_S)
        return verdict

    def pause(self) -> None:
        """Stop the receiver process (SIGSTOP): it then cannot run a single instruction."""
        os.kill(self._launch.pid(self.NAME), signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self._launch.pid(self.NAME), signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the receiver process and reap it."""
        self._launch.kill(self.NAME)

    @property
    def exit_code(self) -> int | None:
        """The receiver's exit code (None while it runs)."""
        return self._launch.exit_code(self.NAME)

    def join(self, timeout_s: float = QUEUE_TIMEOUT_S) -> int | None:
        """Tell the receiver to finish, wait up to `timeout_s` (then kill it); its exit code."""
        if self.exit_code is None:
            with contextlib.suppress(OSError):
                self._launch.send(self.NAME, None)
        return self._launch.close(grace_s=timeout_s)[self.NAME]


def run_senders(
    backend: str, receiver: Receiver, plans: Sequence[Sequence[Sequence[int]]]
) -> list[str]:
    """Run one sender process per plan concurrently; return their verdicts in plan order."""
    verdicts: dict[str, str] = {}
    outcome = Launch(
        [
            Child(
                f"sender{i}",
                sender_worker,
                (backend, receiver.endpoint, receiver.descriptor, [list(p) for p in plan], False),
            )
            for i, plan in enumerate(plans)
        ]
    ).run(
        timeout_s=QUEUE_TIMEOUT_S * 2,
        on_message=lambda name, verdict: verdicts.__setitem__(name, verdict),
    )
    assert outcome.ok, outcome.errors
    return [verdicts[f"sender{i}"] for i in range(len(plans))]


def run_sender_into_stopped_target(
    backend: str, receiver: Receiver, plan: Sequence[Sequence[int]]
) -> str:
    """One sender process that connects while the target runs, then writes `plan` while the
    target is stopped (SIGSTOP); the target is resumed after the sender's verdict. Connecting
    may need the target (ibverbs exchanges queue-pair numbers with its listener thread); the
    writes must not."""
    name = "sender0"
    args = (backend, receiver.endpoint, receiver.descriptor, [list(p) for p in plan], True)
    with Launch([Child(name, sender_worker, args)]) as launch:
        assert launch.recv(name, QUEUE_TIMEOUT_S) == "connected"
        receiver.pause()
        try:
            launch.send(name, "go")
            verdict: str = launch.recv(name, QUEUE_TIMEOUT_S * 2)
        finally:
            receiver.resume()
        codes = launch.join(QUEUE_TIMEOUT_S)
    assert codes[name] == 0, f"{name} {describe_exit(codes[name])}"
    return verdict
