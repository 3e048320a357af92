"""The Transport contract's failure rule: a failed batch may still be running in its backend.

When `poll` raises, the batch has failed, but what the backend started for it may still run:
loopback's copy thread may be copying it, tcp's send thread may still be sending it (or have it
queued), UCX requests and NIXL transfers may still be in flight. A caller may reuse the batch's
source memory only once the batch is *settled* (`WriteHandle.settled`: complete, or failed and
quiesced; `Transport.quiesce` waits for it). The test makes a batch fail while it is in flight,
in a way each backend can really fail, waits for it to settle, overwrites the source (as the
pipeline reuses staging memory), lets the transport run on, and checks that not one byte of the
new source contents reached the target.

Failures injected (per backend, on a sender and receiver in this process, so the target's memory
is visible): loopback, the peer's process seen as exited (what its pidfd reports when an engine
dies); tcp, the link failed as its ack reader fails it when it sees the peer go, while the send
thread still has batches to send; ucx, the flush of each batch failing
while its puts are still in progress (as an endpoint timeout reports); nixl, a transfer reported
failed. ibverbs runs only on an RDMA device (its rule is checked on a simulated device in
tests/unit/test_ibverbs.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conformance._support import backend_of, case_config, first_difference, seeded_bytes
from weight_transfer.backends.base import (
    PeerLostError,
    RegionDescriptor,
    RegionRole,
    Transport,
    WeightTransferError,
    WriteHandle,
    WriteOp,
    create_transport,
)

NUM_BATCHES = 6
BATCH_BYTES = 16 << 20


def _transport(name: str) -> Transport:
    # One ucx lane: batches of 4 MiB and more are otherwise split over copy lanes, whose
    # failures are reported only once their requests finished (tests/unit/test_ucx_lanes.py).
    config = case_config(name)
    if config.name == "ucx":
        config = dataclasses.replace(config, options=config.options + (("lanes", "1"),))
    return create_transport(config)


class _ExitedProcess:
    """What loopback's pidfd check reports once the peer's process has exited."""

    pid = 0

    def alive(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _inject(backend: str, sender: Any) -> Callable[[], None]:
    """Make the batches in flight to "rx" fail; returns what undoes the injection (for the
    backends whose link stays usable)."""
    if backend == "loopback":
        sender._peer_procs["rx"] = _ExitedProcess()
        return lambda: None
    if backend == "tcp":
        # What the ack reader runs when it sees the peer go (a reset, an EOF), here while
        # the connection still carries data, so the send thread could go on sending.
        sender._links["rx"]._fail_all(PeerLostError("tcp: injected: peer 'rx' lost"))
        return lambda: None
    if backend == "ucx":
        from weight_transfer.backends import ucx_native

        worker = sender._worker
        real_check, real_progress = worker.check, worker.progress
        failed: list[bool] = []

        def progress() -> int:
            # Nothing moves until a flush has failed, so the puts are in progress then.
            return real_progress() if failed else 0

        def check(request: ucx_native.Request) -> bool:
            if request.ptr is not None and not real_check(request):
                worker.release(request)  # the flush fails while the puts before it still run
                failed.append(True)
                raise ucx_native.UcxError("UCX request", -80, "injected endpoint timeout")
            return True

        worker.check, worker.progress = check, progress

        def restore() -> None:
            worker.check, worker.progress = real_check, real_progress

        return restore
    if backend == "nixl":
        agent = sender._agent
        real_state = agent.check_xfer_state
        calls = {"n": 0}

        def check_xfer_state(xfer: Any) -> str:
            calls["n"] += 1
            state: str = real_state(xfer)
            return "ERR" if calls["n"] == 1 and state != "ERR" else state

        agent.check_xfer_state = check_xfer_state
        return lambda: setattr(agent, "check_xfer_state", real_state)
    raise AssertionError(f"no failure injection for backend {backend!r}")


def _outcome(sender: Transport, handle: WriteHandle, timeout_s: float) -> str:
    """Poll until the batch completes or fails: "done" or "failed"."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if sender.poll(handle):
                return "done"
        except WeightTransferError:
            return "failed"
        assert time.monotonic() < deadline, "batch neither completed nor failed"
        time.sleep(1e-4)


@pytest.mark.timeout(120)
def test_a_failed_batch_reads_no_source_memory_once_settled(backend: str) -> None:
    name, backend = backend, backend_of(backend)
    if backend == "ibverbs":
        pytest.skip("ibverbs: checked on a simulated device in tests/unit/test_ibverbs.py")
    nbytes = NUM_BATCHES * BATCH_BYTES
    # UCX copies a put of up to 4 MiB (CMA_SEG_SIZE) inside the post: one put per batch, so
    # that the batch is still in progress when its flush is checked.
    op_bytes = BATCH_BYTES if backend == "ucx" else 1 << 20
    receiver, healthy, sender = _transport(name), _transport(name), _transport(name)
    try:
        initial = seeded_bytes(nbytes, 200)
        target = initial.clone()
        desc = RegionDescriptor.from_bytes(
            receiver.register(target, role=RegionRole.TARGET).descriptor.to_bytes()  # type: ignore[union-attr]
        )
        spare = seeded_bytes(4096, 201)
        spare_desc = healthy.register(spare, role=RegionRole.TARGET).descriptor
        assert spare_desc is not None
        original = seeded_bytes(nbytes, 202)
        source = original.clone()
        src = sender.register(source, role=RegionRole.SOURCE)
        sender.connect("rx", receiver.endpoint())
        sender.connect("healthy", healthy.endpoint())

        handles = [
            sender.post_writes(
                "rx",
                [
                    WriteOp(src, b * BATCH_BYTES + o, desc, b * BATCH_BYTES + o, op_bytes)
                    for o in range(0, BATCH_BYTES, op_bytes)
                ],
            )
            for b in range(NUM_BATCHES)
        ]
        restore = _inject(backend, sender)
        outcomes = []
        for b, h in enumerate(handles):
            outcome = _outcome(sender, h, 60)
            if outcome == "failed":
                assert sender.quiesce(h, 30), f"failed batch {h.handle_id} never settled"
            assert h.settled
            outcomes.append(outcome)
            # Settled: the pipeline hands this memory to the next task at once. New contents:
            part = slice(b * BATCH_BYTES, (b + 1) * BATCH_BYTES)
            source[part].copy_(original[part] ^ 0xFF)
        restore()
        print(f"{backend}: {outcomes}")
        assert "failed" in outcomes, f"the injected failure hit no batch in flight: {outcomes}"

        # The transport runs on (its threads; a progress-driven one while it is polled).
        time.sleep(0.3)
        spare_src = sender.register(source[:4096].clone(), role=RegionRole.SOURCE)
        sender.wait(sender.post_writes("healthy", [WriteOp(spare_src, 0, spare_desc, 0, 4096)]), 30)
        time.sleep(0.2)

        leaked = (target == (original ^ 0xFF)) & (target != original) & (target != initial)
        assert int(leaked.sum()) == 0, (
            f"{int(leaked.sum())} target bytes came from the source's new contents after the "
            f"failed batches settled; outcomes {outcomes}"
        )
        mixed = (target != original) & (target != initial)
        assert int(mixed.sum()) == 0, first_difference(target, original)
    finally:
        sender.close()
        receiver.close()
        healthy.close()
