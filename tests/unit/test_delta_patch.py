"""The patch region format: encode runs on the trainer side, apply on the engine side.

Oracle: the engine's regions are plain byte tensors; the runs are slices written here by
hand (offsets, dtypes, sizes); after apply every region must equal, byte for byte, the old
bytes with the new runs copied in by slicing.
"""

from __future__ import annotations

import pytest
import torch

from tests.markers import requires_cuda
from weight_transfer.delta.patch import (
    HEADER_BYTES,
    PatchBuilder,
    PatchError,
    Snapshot,
    apply_patch_region,
    region_header,
    slot_layout,
)

# (region, byte offset, dtype, numel, density)
RUNS = [
    (0, 0, torch.bfloat16, 70_000, 0.02),  # crosses a chunk boundary
    (0, 200_000, torch.bfloat16, 4096, 0.9),  # dense: sent as raw bytes
    (1, 16, torch.float8_e4m3fn, 131_072, 0.01),
    (1, 140_000, torch.float32, 64, 1.0),  # FP8 scales: every one changes
    (2, 8, torch.bfloat16, 1000, 0.0),  # nothing changed: no segment
]
REGION_BYTES = [400_000, 150_000, 4_000]


def _regions(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in REGION_BYTES]


def _new_runs(old: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """New bytes of every run: the old ones with about `density` of the elements changed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for region, off, dtype, numel, density in RUNS:
        size = torch.empty((), dtype=dtype).element_size()
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[size]
        run = old[region][off : off + numel * size].clone().view(ints)
        mask = torch.rand(numel, generator=g) < density
        run[mask] = (run[mask].to(torch.int64) + 1).to(ints)  # a different bit pattern
        out.append(run.view(dtype))
    return out


def _expected(old: list[torch.Tensor], new_runs: list[torch.Tensor]) -> list[torch.Tensor]:
    want = [r.clone() for r in old]
    for (region, off, _, _, _), run in zip(RUNS, new_runs, strict=True):
        b = run.view(torch.uint8)
        want[region][off : off + b.numel()] = b
    return want


def _build(
    old: list[torch.Tensor], new_runs: list[torch.Tensor], step: int, slot_bytes: int
) -> tuple[PatchBuilder, torch.Tensor, int]:
    """A snapshot of the old runs (flat, in run order) and a patch of the new ones."""
    offsets, total = [], 0
    for _, _, dtype, numel, _ in RUNS:
        offsets.append(total)
        total += numel * torch.empty((), dtype=dtype).element_size()
    snap = torch.empty(total, dtype=torch.uint8)
    for (region, off, _, _, _), so, run in zip(RUNS, offsets, new_runs, strict=True):
        n = run.view(torch.uint8).numel()
        snap[so : so + n] = old[region][off : off + n]
    builder = PatchBuilder(torch.zeros(slot_bytes, dtype=torch.uint8))
    for (region, off, dtype, numel, _), so, run in zip(RUNS, offsets, new_runs, strict=True):
        size = numel * torch.empty((), dtype=dtype).element_size()
        builder.add(
            run,
            snap[so : so + size].view(dtype),
            region=region,
            dest_offset=off,
            snapshot_offset=so,
        )
    n = builder.finish(step=step, base_step=step - 1, rank=0)
    return builder, snap, n


def _patch_region(
    slots: list[tuple[int, torch.Tensor]], num_slots: int, slot_bytes: int
) -> torch.Tensor:
    region = torch.full((HEADER_BYTES + num_slots * slot_bytes,), 0xEE, dtype=torch.uint8)
    region[:HEADER_BYTES] = region_header(num_slots, slot_bytes)
    for s, data in slots:
        at = HEADER_BYTES + s * slot_bytes
        region[at : at + data.numel()] = data
    return region


def test_roundtrip_bit_exact_and_snapshot_advances() -> None:
    old = _regions(1)
    new_runs = _new_runs(old, 2)
    slot_bytes = slot_layout(2 * 200_000, 2)
    builder, snap, n = _build(old, new_runs, step=5, slot_bytes=slot_bytes)
    kinds = [s.kind for s in builder.segments]
    assert kinds == [0, 1, 0, 1], kinds  # sparse, dense, sparse, dense; the unchanged run absent
    # The patch is in slot 1; slot 0 holds a stale patch of step 4 that must be skipped.
    stale, _, m = _build(old, _new_runs(old, 3), step=4, slot_bytes=slot_bytes)
    region = _patch_region([(0, stale.staging[:m]), (1, builder.staging[:n])], 2, slot_bytes)
    engine = [r.clone() for r in old]
    stats = apply_patch_region(region, engine, 5, base_step=4)
    assert stats.num_slots == 1 and stats.num_segments == 4 and stats.patch_bytes == n
    for got, want in zip(engine, _expected(old, new_runs), strict=True):
        assert torch.equal(got, want)
    # The snapshot advances with the same patch to exactly the new runs.
    s = Snapshot(snap.numel(), torch.device("cpu"))
    s.buffer.copy_(snap)
    s.advance(builder)
    flat = torch.cat([r.view(torch.uint8) for r in new_runs])
    assert torch.equal(s.buffer, flat)
    # Applying twice is harmless (idempotent), which is what makes a retry safe.
    apply_patch_region(region, engine, 5)
    for got, want in zip(engine, _expected(old, new_runs), strict=True):
        assert torch.equal(got, want)


def test_patch_is_small_at_low_density() -> None:
    old = _regions(4)
    new_runs = _new_runs(old, 5)
    builder, _, n = _build(old, new_runs, step=1, slot_bytes=1 << 20)
    full = sum(r.view(torch.uint8).numel() for r in new_runs)
    # Sparse runs cost 2 + value bytes per change (+ chunk offsets); dense ones their bytes.
    assert n < 0.2 * full, (n, full)


DAMAGES = {
    "magic": "no header",
    "table": "table or size",
    "region": "segment 0: bad region",
    "dest": "segment 0: destination outside",
    "offsets": "segment 0: chunk offsets",
    "kind": "segment 0: unknown kind",
    "entries": "segment 0: 0 entries",
    "data": "segment 0: data outside the slot",
    "numel_huge": "segment 0: destination outside",  # numel * size would overflow int64
    "dest_huge": "segment 0: destination outside",
    "second_dest": "segment 1: destination outside",  # the first segment is fine
    "negative_chunk": "segment 0: chunk offsets are not a prefix sum",
    # Issue 40, finding 5: these wrote (or raised torch's RuntimeError) before refusing.
    "last_index": "segment 0: an entry lies past the end of its run",
    "slot_bytes": "slot size 524284 is not a multiple of 8",
    "table_align": r"patch slot 0: table offset \d+ is not a multiple of 8",
}


def _damaged(damage: str, old: list[torch.Tensor]) -> torch.Tensor:
    """A patch region of one valid patch of step 2 over `old`, then damaged as `DAMAGES` says."""
    slot_bytes = 1 << 19
    builder, _, n = _build(old, _new_runs(old, 7), step=2, slot_bytes=slot_bytes)
    data = builder.staging[:n].clone()
    words = data.view(torch.int64)
    table = int(words[5]) // 8
    if damage == "magic":
        region = _patch_region([(0, data)], 1, slot_bytes)
        region[:8] = 0
    elif damage == "slot_bytes":
        region = _patch_region([(0, data)], 2, slot_bytes)
        region[:HEADER_BYTES].view(torch.int64)[2] = slot_bytes - 4  # slot 1 is unaligned
    else:
        if damage == "table":
            words[5] += 8
        elif damage == "region":
            words[table] = 7  # first segment names a region that does not exist
        elif damage == "dest":
            words[table + 1] = REGION_BYTES[0] - 2  # runs past the end of its region
        elif damage == "offsets":
            d0 = int(words[table + 6]) // 8
            words[d0 + 1] = 10**9  # chunk offsets no longer a prefix sum of the entries
        elif damage == "kind":
            words[table + 4] = 7
        elif damage == "entries":
            words[table + 5] = 0
        elif damage == "data":
            words[table + 6] = words[5]  # data starting at the table runs into it
        elif damage == "numel_huge":
            words[table + 3] = 2**62
        elif damage == "dest_huge":
            words[table + 1] = 2**62
        elif damage == "second_dest":
            words[table + 8 + 1] = REGION_BYTES[0]
        elif damage == "negative_chunk":
            d0 = int(words[table + 6]) // 8
            words[d0 + 1] = -5  # RUNS[0] has two chunks: offsets [0, c0, c0 + c1]
        elif damage == "last_index":
            # RUNS[0]'s second chunk holds 70,000 - 65,536 = 4,464 elements: an entry indexing
            # element 4,464 of it lies past the run (the dense segments are applied first).
            d0 = int(words[table + 6]) // 8
            c0 = int(words[d0 + 1])
            index = data[8 * d0 + 24 :].view(torch.int16)  # after the 3 chunk offsets
            index[c0] = 70_000 - 65_536
        elif damage == "table_align":
            words[5] += 4  # table offset and used bytes both moved by 4: consistent but unaligned
            words[3] += 4
        region = _patch_region([(0, data)], 1, slot_bytes)
    return region


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_corrupt_patch_refused_and_nothing_written(damage: str) -> None:
    old = _regions(6)
    region = _damaged(damage, old)
    engine = [r.clone() for r in old]
    with pytest.raises(PatchError, match=DAMAGES[damage]):
        apply_patch_region(region, engine, 2)
    for got, want in zip(engine, old, strict=True):
        assert torch.equal(got, want), "a refused patch wrote something"


@requires_cuda
@pytest.mark.parametrize("damage", ["last_index", "slot_bytes", "table_align"])
def test_gpu_corrupt_patch_refused_and_nothing_written(damage: str) -> None:
    """The table kernels dropped an index past a partial last chunk without a word: the
    checks run before them, on the GPU too."""
    old = _regions(6)
    region = _damaged(damage, old).cuda()
    engine = [r.cuda() for r in old]
    with pytest.raises(PatchError, match=DAMAGES[damage]):
        apply_patch_region(region, engine, 2)
    torch.cuda.synchronize()
    for got, want in zip(engine, old, strict=True):
        assert torch.equal(got.cpu(), want), "a refused patch wrote something"


def test_base_step_mismatch_refused() -> None:
    old = _regions(8)
    builder, _, n = _build(old, _new_runs(old, 9), step=3, slot_bytes=1 << 19)
    region = _patch_region([(0, builder.staging[:n])], 1, 1 << 19)
    engine = [r.clone() for r in old]
    with pytest.raises(PatchError, match="encoded against version 2"):
        apply_patch_region(region, engine, 3, base_step=1)
    assert all(torch.equal(a, b) for a, b in zip(engine, old, strict=True))


def test_overflow_raises_and_adds_nothing() -> None:
    old = _regions(10)
    new_runs = _new_runs(old, 11)
    builder = PatchBuilder(torch.zeros(4096, dtype=torch.uint8))
    region, off, dtype, numel, _ = RUNS[0]
    size = numel * 2
    with pytest.raises(PatchError, match="too dense"):
        builder.add(
            new_runs[0],
            old[region][off : off + size].view(dtype),
            region=0,
            dest_offset=0,
            snapshot_offset=0,
        )
    assert builder.segments == [] and builder.wire_bytes == HEADER_BYTES


def _runs_over(
    new_runs: list[torch.Tensor], snap: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, int, int, int]]:
    """(new, old, region, dest_offset, snapshot_offset) of every run, the old bytes in `snap`
    laid out run after run as `_build` lays them."""
    so = 0
    runs = []
    for (region, off, dtype, numel, _), run in zip(RUNS, new_runs, strict=True):
        size = numel * torch.empty((), dtype=dtype).element_size()
        runs.append((run, snap[so : so + size].view(dtype), region, off, so))
        so += size
    return runs


def test_count_then_add_counted_equals_add() -> None:
    """The batched path (count every run, one read of all totals, then encode) writes the same
    slot bytes as `add` run by run (the GPU sender uses the first, the CPU one the second)."""
    old = _regions(12)
    new_runs = _new_runs(old, 13)
    one, snap, n = _build(old, new_runs, step=2, slot_bytes=1 << 20)
    two = PatchBuilder(torch.zeros(1 << 20, dtype=torch.uint8))
    runs = _runs_over(new_runs, snap)
    counted = [two.count(a, b) for a, b, _, _, _ in runs]
    totals = torch.stack([o[-1] for o in counted]).tolist()
    for (a, b, region, off, at), offsets, total in zip(runs, counted, totals, strict=True):
        two.add_counted(
            a, b, offsets, int(total), region=region, dest_offset=off, snapshot_offset=at
        )
    m = two.finish(step=2, base_step=1, rank=0)
    assert m == n and torch.equal(two.staging[:m], one.staging[:n])


def test_add_runs_equals_add() -> None:
    """`add_runs` (on a GPU, and here under triton's interpreter: the table kernels, one
    synchronization per batch) writes the same slot bytes as `add` run by run, and the patch
    it built applies (through the engine's batched apply) and advances a snapshot exactly."""
    old = _regions(14)
    new_runs = _new_runs(old, 15)
    one, snap, n = _build(old, new_runs, step=2, slot_bytes=1 << 20)
    two = PatchBuilder(torch.zeros(1 << 20, dtype=torch.uint8))
    runs = _runs_over(new_runs, snap)
    two.add_runs(runs)
    m = two.finish(step=2, base_step=1, rank=0)
    assert m == n and torch.equal(two.staging[:m], one.staging[:n])
    region = _patch_region([(0, two.staging[:m])], 1, 1 << 20)
    engine = [r.clone() for r in old]
    apply_patch_region(region, engine, 2, base_step=1)
    for got, want in zip(engine, _expected(old, new_runs), strict=True):
        assert torch.equal(got, want)
    s = Snapshot(snap.numel(), torch.device("cpu"))
    s.buffer.copy_(snap)
    s.advance(two)
    assert torch.equal(s.buffer, torch.cat([r.view(torch.uint8) for r in new_runs]))


@requires_cuda
def test_gpu_engine_with_a_host_region_applies_by_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's version word lives in host memory while its weights and patch region are
    on the GPU: every sparse segment must still go through the table kernels (the per-segment
    path, `apply_changes`, once ran for all 7,869 segments of an MoE patch because one region
    was on the host), and the result is the old bytes with the new runs sliced in."""
    import weight_transfer.delta.patch as delta_mod

    old = _regions(21)
    new_runs = _new_runs(old, 22)
    slot = slot_layout(1 << 20, 1)
    builder, _, n = _build(old, new_runs, 3, slot)
    patch = _patch_region([(0, builder.staging[:n])], 1, slot).cuda()
    regions = [r.cuda() for r in old] + [torch.zeros(8, dtype=torch.uint8)]  # + host word

    def per_segment(*_: object) -> None:
        raise AssertionError("a sparse segment took the per-segment path")

    monkeypatch.setattr(delta_mod, "apply_changes", per_segment)
    stats = apply_patch_region(patch, regions, 3)
    torch.cuda.synchronize()
    assert stats.num_segments == 4
    for got, want in zip(regions, _expected(old, new_runs), strict=False):
        assert torch.equal(got.cpu(), want)


@requires_cuda
def test_gpu_patch_advances_a_pinned_host_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer's snapshot in pinned host memory (`snapshot_memory="host"`) advances by a
    GPU patch through the table kernels writing its mapped address, never segment by segment
    on the CPU, and ends as the new runs' bytes."""
    import weight_transfer.delta.patch as delta_mod

    old = _regions(31)
    new_runs = _new_runs(old, 32)
    _, snap, _ = _build(old, new_runs, step=2, slot_bytes=1 << 20)
    builder = PatchBuilder(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
    builder.add_runs(_runs_over([r.cuda() for r in new_runs], snap.cuda()))
    builder.finish(step=2, base_step=1, rank=0)
    host = Snapshot(snap.numel(), torch.device("cpu"), pin=True)
    host.buffer.copy_(snap)

    def per_segment(*_: object) -> None:
        raise AssertionError("a sparse segment took the per-segment path")

    monkeypatch.setattr(delta_mod, "apply_changes", per_segment)
    host.advance(builder)
    assert host.buffer.is_pinned()
    assert torch.equal(host.buffer, torch.cat([r.view(torch.uint8) for r in new_runs]))
