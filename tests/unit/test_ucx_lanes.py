"""The ucx backend's parallel copy lanes (option `lanes`): a large host batch is cut into
contiguous shares, one per lane, each posted and progressed on its own worker and thread.
"""

from __future__ import annotations

import pytest
import torch

from tests.markers import requires_module
from weight_transfer.backends.base import (
    ConfigurationError,
    RegionRole,
    TransportConfig,
    TransportError,
    WriteOp,
)


@pytest.mark.parametrize("value", ["0", "-1", "two", "17", "1.5", ""])
def test_bad_lanes_are_refused_by_name(value: str) -> None:
    from weight_transfer.backends.ucx import UcxTransport

    with pytest.raises(ConfigurationError, match="lanes"):
        UcxTransport(TransportConfig(name="ucx", options=(("lanes", value),)))


def test_split_keeps_every_byte_in_place() -> None:
    """Pieces of the shares, laid end to end, are the ops' (source, target) byte ranges."""
    from weight_transfer.backends.ucx import _PAGE_BYTES, _split_over_lanes, _Target

    gen = torch.Generator().manual_seed(5)
    for lanes in (2, 3, 4):
        target = _Target(base=1 << 40, nbytes=1 << 30, rkey=7, lane_rkeys=tuple(range(lanes)))
        sizes = torch.randint(1, 3 << 20, (11,), generator=gen).tolist()
        resolved = []
        src = dst = 0
        for n in sizes:
            resolved.append((1000 + src, n, target.base + 3 * dst + 1, target, None))
            src += n + 17  # gaps between ops: each piece must keep its own op's addresses
            dst += n
        total = sum(sizes)
        shares = _split_over_lanes(resolved, total, lanes)  # type: ignore[arg-type]
        assert len(shares) == lanes
        share_bytes = [sum(p[1] for p in share) for share in shares]
        assert sum(share_bytes) == total
        assert all(b % _PAGE_BYTES == 0 for b in share_bytes[:-1])
        assert max(share_bytes) - min(share_bytes) <= _PAGE_BYTES * lanes
        assert all(p[3] == i for i, share in enumerate(shares) for p in share)  # lane's rkey
        pieces = [p for share in shares for p in share]
        i = 0
        for address, n, remote, _, _ in resolved:
            end = address + n
            while address < end:
                a, m, r = pieces[i][:3]
                assert (a, r) == (address, remote)
                address, remote, i = address + m, remote + m, i + 1
            assert address == end
        assert i == len(pieces)


def _pair(lanes: int) -> tuple[object, object]:
    from weight_transfer.backends.ucx import UcxTransport

    rx = UcxTransport(TransportConfig(name="ucx", options=(("lanes", "1"),)))
    tx = UcxTransport(TransportConfig(name="ucx", options=(("lanes", str(lanes)),)))
    return rx, tx


@requires_module("libucx")
@pytest.mark.parametrize("lanes", [2, 3])
def test_split_batches_land_bit_exact(lanes: int) -> None:
    from weight_transfer.backends.ucx import UcxTransport, _LaneBatch

    rx, tx = _pair(lanes)
    assert isinstance(rx, UcxTransport) and isinstance(tx, UcxTransport)
    try:
        gen = torch.Generator().manual_seed(23 + lanes)
        n = (9 << 20) + 13
        target = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        tx.connect("rx", rx.endpoint())
        source = torch.empty(n, dtype=torch.uint8)
        src = tx.register(source, role=RegionRole.SOURCE)
        for step in range(2):
            source.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
            # odd pieces, written in reverse halves: target [0, h) <- source [n-h, n) and so on
            h = n // 2 + 1
            ops = [
                WriteOp(src, n - h, desc, 0, 5),
                WriteOp(src, n - h + 5, desc, 5, h - 5),
                WriteOp(src, 0, desc, h, n - h),
            ]
            handle = tx.post_writes("rx", ops)
            assert isinstance(handle.state, _LaneBatch) and handle.state.remaining <= lanes
            tx.wait(handle, timeout_s=30)
            assert torch.equal(target[:h], source[n - h :]), step
            assert torch.equal(target[h:], source[: n - h]), step
        small = tx.post_writes("rx", [WriteOp(src, 0, desc, 0, 1 << 20)])
        assert not isinstance(small.state, _LaneBatch)  # below the split size: inline
        tx.wait(small, timeout_s=30)
        assert torch.equal(target[: 1 << 20], source[: 1 << 20])
        threads = [lane.thread for lane in tx._lanes]
        assert len(threads) == lanes and all(t is not None and t.is_alive() for t in threads)
    finally:
        tx.close()
        rx.close()
    assert not any(t is not None and t.is_alive() for t in threads)


@requires_module("libucx")
def test_a_failing_lane_fails_the_batch_naming_the_peer() -> None:
    from weight_transfer.backends import ucx_native
    from weight_transfer.backends.ucx import UcxTransport

    rx, tx = _pair(2)
    assert isinstance(rx, UcxTransport) and isinstance(tx, UcxTransport)
    try:
        gen = torch.Generator().manual_seed(3)
        n = 8 << 20
        target = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        tx.connect("rx", rx.endpoint())
        source = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        src = tx.register(source, role=RegionRole.SOURCE)

        def refuse(*_: object) -> list[int]:
            raise ucx_native.UcxError("ucp_put_nbx", -3, "injected")

        tx._lanes[1].worker.put_many = refuse  # type: ignore[method-assign,assignment]
        handle = tx.post_writes("rx", [WriteOp(src, 0, desc, 0, n)])
        with pytest.raises(TransportError, match=r"'rx'.*copy lane 1.*injected"):
            tx.wait(handle, timeout_s=30)
        assert torch.equal(target[: n // 2], source[: n // 2])  # lane 0's share still landed
    finally:
        tx.close()
        rx.close()


class _FakeWorker:
    """Stands in for UcxWorker's request bookkeeping: which requests UCX still runs, which
    were freed as finished, and which were given up on (cancelled and freed) while running."""

    def __init__(self, flush_fails: bool, in_progress: set[int]) -> None:
        self.flush_fails = flush_fails
        self.in_progress = in_progress
        self.freed: list[int] = []
        self.released: list[int] = []

    def check(self, request):
        from weight_transfer.backends import ucx_native

        request.ptr = None  # the real check frees the request whatever its status
        if self.flush_fails:
            raise ucx_native.UcxError("UCX request", -3, "Endpoint timeout")
        return True

    def sweep(self, requests):
        self.freed += [r for r in requests if r not in self.in_progress]
        return [r for r in requests if r in self.in_progress], None

    def release_all(self, requests):
        self.released.extend(requests)

    def release(self, request):
        if request.ptr is not None:
            self.released.append(request.ptr)
            request.ptr = None


def test_a_failed_flush_keeps_the_puts_still_running_until_they_finish() -> None:
    """A failed flush used to cancel and free the batch's outstanding puts at once; freeing a
    UCX request does not stop its operation, so a put could still read staging memory after
    the batch was reported failed (and its memory reused). Now the failure is recorded, the
    puts still in progress are kept (never given up on) and freed only once they finished:
    until then the batch is not quiet (`UcxTransport._quiesce`)."""
    from weight_transfer.backends import ucx, ucx_native

    worker = _FakeWorker(flush_fails=True, in_progress={0x2000})
    batch = ucx._Batch(puts=[0x1000, 0x2000, 0x3000], flush=ucx_native.Request(0x9000, 1))
    assert ucx._settle(worker, batch) is False
    assert batch.failure is not None and "Endpoint timeout" in batch.failure
    assert batch.flush is None and batch.puts == [0x1000, 0x2000, 0x3000]
    assert ucx._quiet(worker, batch) is False
    assert batch.puts == [0x2000] and worker.freed == [0x1000, 0x3000]
    worker.in_progress.clear()  # UCX finished the last put
    assert ucx._quiet(worker, batch) is True
    assert worker.freed == [0x1000, 0x3000, 0x2000] and worker.released == []
    ok = _FakeWorker(flush_fails=False, in_progress=set())
    batch = ucx._Batch(puts=[0x1000], flush=ucx_native.Request(0x9000, 1))
    assert ucx._settle(ok, batch) and ok.released == [] and batch.failure is None
