"""Helpers and spawn-able worker functions for the conformance suite.

Workers are module-level (spawn pickles them by name) and talk to the parent only through
multiprocessing queues carrying bytes, ints and strings; write plans travel as msgpack bytes.
A worker reports "ok" or an error string and exits non-zero on failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import traceback
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from weight_transfer.backends.base import (
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportConfig,
    WriteOp,
    create_transport,
)

BACKEND_NAMES: list[str] = ["loopback", "tcp", "ucx", "nixl", "ibverbs"]
"""Every backend the suite runs on; one that cannot run here is skipped with its reason."""

QUEUE_TIMEOUT_S = 60.0
"""How long the parent waits for any message from a child."""

CTX = mp.get_context("spawn")

# Sizes of the ops a sender splits a range into, cycled: odd on purpose, 1 byte to 1 MiB + 3.
ODD_SIZES = (1, 3, 4093, 7, 65537, 2, 1048579, 129)


def seeded_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` seeded random bytes (uint8); never zeros, so a wrong offset shows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def make_transport(backend: str) -> Transport:
    """A transport of `backend` with the default config."""
    return create_transport(TransportConfig(name=backend))


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
# Workers (run in spawned processes).
# ---------------------------------------------------------------------------------------------


def receiver_worker(
    backend: str, nbytes: int, init_seed: int, to_parent: Any, from_parent: Any
) -> None:
    """Register a seeded TARGET, publish it, then check it against the plan the parent sends.

    Runs no code while the writes happen: it blocks on the parent's queue.
    """
    transport = make_transport(backend)
    try:
        target = seeded_bytes(nbytes, init_seed)
        region = transport.register(target, role=RegionRole.TARGET)
        assert region.descriptor is not None
        to_parent.put(("ready", transport.endpoint(), region.descriptor.to_bytes()))
        plan = msgpack.unpackb(from_parent.get(timeout=QUEUE_TIMEOUT_S * 3))
        verdict = first_difference(target, expected_after(nbytes, init_seed, plan))
        to_parent.put(("ok" if verdict == "equal" else f"mismatch: {verdict}",))
        if verdict != "equal":
            raise SystemExit(1)
    finally:
        transport.close()


def sender_worker(
    backend: str, name: str, endpoint: bytes, descriptor: bytes, plan: bytes, to_parent: Any
) -> None:
    """Write each (offset, length, seed) range of `plan` in odd-sized ops, two batches per range."""
    try:
        transport = make_transport(backend)
        try:
            desc = RegionDescriptor.from_bytes(descriptor)
            transport.connect("receiver", endpoint)
            handles = []
            sources = []
            for offset, length, seed in msgpack.unpackb(plan):
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
    except BaseException:
        to_parent.put((name, f"error: {traceback.format_exc()}"))
        raise
    to_parent.put((name, "ok"))


# ---------------------------------------------------------------------------------------------
# Parent-side orchestration.
# ---------------------------------------------------------------------------------------------


class Receiver:
    """A receiver_worker process and its queues."""

    def __init__(self, backend: str, nbytes: int, init_seed: int) -> None:
        self.nbytes = nbytes
        self.init_seed = init_seed
        self.to_parent = CTX.Queue()
        self.from_parent = CTX.Queue()
        self.process = CTX.Process(
            target=receiver_worker,
            args=(backend, nbytes, init_seed, self.to_parent, self.from_parent),
            name="conformance-receiver",
        )
        self.process.start()
        msg = self.to_parent.get(timeout=QUEUE_TIMEOUT_S)
        assert msg[0] == "ready", msg
        self.endpoint: bytes = msg[1]
        self.descriptor: bytes = msg[2]

    def check(self, plan: Sequence[Sequence[int]]) -> str:
        """Ask the receiver to compare its memory with `plan`; return its verdict."""
        self.from_parent.put(msgpack.packb([list(p) for p in plan]))
        verdict: str = self.to_parent.get(timeout=QUEUE_TIMEOUT_S)[0]
        return verdict

    def pause(self) -> None:
        """Stop the receiver process (SIGSTOP): it then cannot run a single instruction."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGCONT)


def run_senders(
    backend: str, receiver: Receiver, plans: Sequence[Sequence[Sequence[int]]]
) -> list[str]:
    """Run one sender process per plan concurrently; return their verdicts in plan order."""
    results = CTX.Queue()
    procs = []
    for i, plan in enumerate(plans):
        proc = CTX.Process(
            target=sender_worker,
            args=(
                backend,
                f"sender{i}",
                receiver.endpoint,
                receiver.descriptor,
                msgpack.packb([list(p) for p in plan]),
                results,
            ),
            name=f"conformance-sender{i}",
        )
        proc.start()
        procs.append(proc)
    verdicts: dict[str, str] = {}
    try:
        for _ in procs:
            name, verdict = results.get(timeout=QUEUE_TIMEOUT_S * 2)
            verdicts[name] = verdict
    except queue.Empty:
        verdicts.setdefault("timeout", "a sender did not report in time")
    finally:
        join_all(procs)
    for proc in procs:
        assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}: {verdicts}"
    return [verdicts[f"sender{i}"] for i in range(len(plans))]


def join_all(procs: Sequence[Any], timeout_s: float = QUEUE_TIMEOUT_S) -> None:
    """Join every process; kill (by handle) any that outlives `timeout_s`."""
    for proc in procs:
        proc.join(timeout=timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
