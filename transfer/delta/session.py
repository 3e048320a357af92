"""The trainer side of delta updates: which updates are deltas, and the layer that turns the
pipeline's writes into patches.

The pipeline is unchanged by delta mode: it gathers, fuses, slices and quantizes exactly as for
a full update and hands its writes to the transport. `DeltaTransport` stands between it and the
real transport. In a *full* update it passes every write through and copies the bytes into
the snapshot (`weight_transfer.delta.patch.Snapshot`) on the way. In a *delta* update it posts
nothing: each write's bytes are compared with the snapshot and encoded into that engine's
`PatchBuilder` (the write "completes" at once, so the pipeline frees its staging as soon as
the bytes are encoded), and `DeltaSession.post_patches` then writes every engine's patch into
its slot of the engine's patch region. Version words always pass through.

`DeltaSession` decides per update and per rank (a rank's decision needs nobody else's: each
engine byte is written by one rank, and each rank has its own slot):

* full: the first update, after a full update failed (the engine's bytes are then unknown),
  every `anchor_every_updates`, when the last delta put more than `max_wire_fraction` of the
  full bytes on the wire, when an engine has no patch region, or when an engine could not
  apply the last patch;
* delta otherwise.

Before any write into an engine that was sent a delta, the rank waits (bounded) until that
engine said it applied it: the patch slot is about to be reused, and a full write must not race
with an apply of the previous patch. The snapshot advances only once the update committed; a
failed delta leaves snapshot and engine as they were.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from weight_transfer.backends.base import (
    PreparedWrites,
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportTimeoutError,
    WeightTransferError,
    WriteHandle,
    WriteOp,
)
from weight_transfer.config import DeltaConfig
from weight_transfer.control import ControlPlane
from weight_transfer.delta.patch import (
    HEADER_BYTES,
    PatchBuilder,
    PatchError,
    Snapshot,
    applied_key,
    region_header,
    slot_layout,
)
from weight_transfer.delta.verify import DeltaVerifier
from weight_transfer.kernels import table_copy
from weight_transfer.kernels.delta import use_kernels, uses_triton
from weight_transfer.planner.types import QuantWrite, RankSchedule, SliceWrite, dtype_size
from weight_transfer.protocol import Decision

log = logging.getLogger(__name__)

FULL, DELTA = "full", "delta"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeltaStats:
    """What delta mode did in one update (`UpdateStats.delta`)."""

    mode: str
    """"full" or "delta"."""
    reason: str
    """Why this mode (e.g. "first update", "anchor", "dense: 0.61 of full last time")."""
    wire_bytes: int
    """Bytes put on the wire for the weights (the patches in a delta, everything in a full)."""
    full_bytes: int
    """Bytes a full update of this rank writes."""
    num_segments: int = 0
    """Runs that changed (delta)."""
    encode_s: float = 0.0
    """Seconds spent comparing and encoding (delta)."""
    apply_wait_s: float = 0.0
    """Seconds waited for the engines to apply the previous delta."""


class _ElemSizes:
    """Element size of the engine bytes at (engine, region, offset), from the schedule's writes
    (2 for BF16, 1 for FP8 weights, 4 for scales). Only the encoding's efficiency depends on
    it: 1 is always correct."""

    def __init__(self, schedule: RankSchedule) -> None:
        spans: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        for task in schedule.tasks:
            for w in task.writes:
                if isinstance(w, SliceWrite):
                    runs = [(r, dtype_size(w.dtype)) for r in w.runs]
                elif isinstance(w, QuantWrite):
                    runs = [(r, 1) for r in w.weight_runs] + [(r, 4) for r in w.scale_runs]
                else:  # pragma: no cover - no other write kinds
                    continue
                for r, size in runs:
                    spans.setdefault((w.engine, r.region), []).append(
                        (r.offset_bytes, r.offset_bytes + r.nbytes, size)
                    )
        self._starts = {k: [s for s, _, _ in sorted(v)] for k, v in spans.items()}
        self._spans = {k: sorted(v) for k, v in spans.items()}

    def of(self, engine: str, region: int, offset: int, nbytes: int) -> int:
        spans = self._spans.get((engine, region))
        if not spans:
            return 1
        i = bisect.bisect_right(self._starts[(engine, region)], offset) - 1
        if i < 0:
            return 1
        start, end, size = spans[i]
        if offset + nbytes <= end and (offset - start) % size == 0 and nbytes % size == 0:
            return size
        return 1


class SpeedGuard:
    """`DeltaConfig.full_when_slower`: remembers how long this rank's last full and last delta
    update took and says when the next update should be full because deltas are slower."""

    def __init__(self, *, enabled: bool, retry_after: int) -> None:
        self.enabled = enabled
        self.retry_after = retry_after
        self.last_full_s: float | None = None
        self.last_delta_s: float | None = None
        self._slower = False
        self._fulls_since = 0

    def record(self, mode: str, seconds: float) -> None:
        """A committed update of `mode` took `seconds` (the whole update call)."""
        if mode == DELTA:
            self.last_delta_s = seconds
            self._slower = self.last_full_s is not None and seconds > self.last_full_s
            self._fulls_since = 0
        else:
            self.last_full_s = seconds
            if self._slower:
                self._fulls_since += 1

    def reason_for_full(self) -> str | None:
        """Why the next update should be full (None: a delta may run)."""
        if not self.enabled or not self._slower or self._fulls_since >= self.retry_after:
            return None
        assert self.last_delta_s is not None and self.last_full_s is not None
        return (
            f"slower: the last delta took {self.last_delta_s * 1e3:.1f} ms, a full update "
            f"{self.last_full_s * 1e3:.1f} ms (a delta again after {self.retry_after} full "
            "updates)"
        )


@dataclasses.dataclass(slots=True)
class _Slot:
    """This rank's slot in one engine's patch region, and the staging it is built in."""

    engine: str
    descriptor: RegionDescriptor
    slot_offset: int
    builder: PatchBuilder
    header_at: int
    """Offset of this engine's region header bytes in the staging region."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Columns:
    """A batch of writes as int64 columns, one entry per write."""

    sources: tuple[Any, ...]
    """The distinct source regions; `source` indexes them."""
    source: np.ndarray
    source_offset: np.ndarray
    snapshot_offset: np.ndarray
    nbytes: np.ndarray
    esize: np.ndarray
    region: np.ndarray
    dest: np.ndarray

    def source_ptr(self) -> np.ndarray:
        """Each write's source address now (the regions' tensors may be moved between
        updates; their addresses are read again every time)."""
        base = np.array([r.tensor.data_ptr() for r in self.sources], dtype=np.int64)
        out: np.ndarray = base[self.source] + self.source_offset
        return out


_INT_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _int_run(op: WriteOp, size: int) -> torch.Tensor:
    """A write's source bytes as a flat integer view of element size `size`."""
    src = op.source.tensor[op.source_offset : op.source_offset + op.nbytes]
    return src.view(_INT_DTYPE[size])


def _copy_into(
    buffer: torch.Tensor,
    offsets: np.ndarray,
    src_ptr: np.ndarray,
    nbytes: np.ndarray,
    ops: Sequence[WriteOp],
) -> None:
    """buffer[offsets[i]:][:nbytes[i]] = write i's source bytes, for every write of a batch: on
    one GPU the aligned ones as table-copy launches (`weight_transfer.kernels.table_copy`),
    the rest as one copy each."""
    first = ops[0].source.tensor
    rest: Sequence[int] = range(len(ops))
    if buffer.is_cuda and buffer.device == first.device and table_copy.available():
        dst = buffer.data_ptr() + offsets
        ok = (dst % table_copy.ALIGN == 0) & (src_ptr % table_copy.ALIGN == 0)
        ok &= nbytes % table_copy.ALIGN == 0
        table = table_copy.chunk_arrays(dst[ok], src_ptr[ok], nbytes[ok])
        with torch.cuda.device(buffer.device):
            table_copy.launch(table_copy.to_device(table, buffer.device, int(ok.sum())))
        rest = np.flatnonzero(~ok).tolist()
    for i in rest:
        op = ops[i]
        at = int(offsets[i])
        src = op.source.tensor[op.source_offset : op.source_offset + op.nbytes]
        buffer[at : at + op.nbytes].copy_(src, non_blocking=buffer.is_pinned())


class DeltaTransport:
    """The transport the pipeline sees in delta mode (module docstring). Forwards everything
    it does not change to the real transport; not thread-safe (the write stage drives it)."""

    def __init__(self, inner: Transport, session: DeltaSession) -> None:
        self.inner = inner
        self.session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def mapped_view(self, *args: Any, **kwargs: Any) -> None:
        """Never a mapped view: every byte must pass through the delta layer (to be snapshotted
        or encoded), so kernels do not write into engine memory directly in delta mode."""
        return None

    def post_writes(self, peer: str, ops: Sequence[WriteOp]) -> WriteHandle:
        """Full: snapshot, then post. Delta: encode, complete at once. Version words pass."""
        if self.session.intercepts(ops):
            handle = self.session.take(peer, ops)
            if handle is not None:
                return handle
        return self.inner.post_writes(peer, ops)

    def prepare_writes(self, peer: str, ops: Sequence[WriteOp]) -> PreparedWrites:
        """A batch the pipeline posts every update: prepared on the real transport only when
        a full update first posts it."""
        return PreparedWrites(
            peer=peer,
            ops=tuple(ops),
            nbytes=sum(op.nbytes for op in ops),
            sources=tuple({id(op.source): op.source for op in ops}.values()),
            state={"inner": None},
        )

    def post_prepared(self, prepared: PreparedWrites) -> WriteHandle:
        """As `post_writes` for a prepared batch (a full update posts it prepared on the real
        transport; the delta layer keeps its per-batch columns in the batch's state)."""
        state = prepared.state
        if self.session.intercepts(prepared.ops):
            handle = self.session.take(prepared.peer, prepared.ops, state)
            if handle is not None:
                return handle
        if state["inner"] is None:
            state["inner"] = self.inner.prepare_writes(prepared.peer, prepared.ops)
        return self.inner.post_prepared(state["inner"])

    def poll(self, handle: WriteHandle) -> bool:
        """Encoded batches are done when returned; others ask the real transport."""
        if handle.state == "encoded":
            return True
        return self.inner.poll(handle)

    def completion_event(self, handle: WriteHandle) -> Any:
        """None for encoded batches (already done)."""
        if handle.state == "encoded":
            return None
        return self.inner.completion_event(handle)

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Encoded batches are done; others wait on the real transport."""
        if handle.state != "encoded":
            self.inner.wait(handle, timeout_s)


class DeltaSession:
    """One trainer rank's delta state across updates: snapshot, patch slots, decisions."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        config: DeltaConfig,
        schedule: RankSchedule,
        transport: Transport,
        descriptors: Mapping[str, Sequence[RegionDescriptor]],
        version_regions: Mapping[str, int],
        control: ControlPlane,
        device: torch.device,
        writers: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """`writers` (engine -> trainer ranks writing it) only on the rank that hosts the
        controller: it judges `DeltaConfig.verify`."""
        self.rank = rank
        self.verifier = (
            DeltaVerifier(
                rank=rank,
                control=control,
                writers=writers,
                timeout_s=config.apply_timeout_s,
            )
            if config.verify
            else None
        )
        self.config = config
        use_kernels(config.kernels)
        self.transport = transport
        self.control = control
        self.device = device
        self._region_index: dict[int, tuple[str, int]] = {}
        self._version_descs: set[int] = set()
        for engine, descs in descriptors.items():
            for i, d in enumerate(descs):
                self._region_index[id(d)] = (engine, i)
            self._version_descs.add(id(descs[version_regions[engine]]))
        self.full_bytes = sum(w.nbytes for t in schedule.tasks for w in t.writes)
        self._sizes = _ElemSizes(schedule)
        self._offsets: dict[tuple[str, int, int, int], int] = {}
        self._next_offset = 0
        self._layout_gen = 0
        """Bumped whenever `_offsets` is laid out anew (cached batch columns then expire)."""
        # Patch slots: the region right after an engine's version word, split over the ranks.
        slots: dict[str, tuple[RegionDescriptor, int, int]] = {}
        self.missing_patch_region = sorted(
            e for e in schedule.peers if len(descriptors[e]) <= version_regions[e] + 1
        )
        for engine in schedule.peers:
            if engine in self.missing_patch_region:
                continue
            desc = descriptors[engine][version_regions[engine] + 1]
            slot_bytes = slot_layout(desc.nbytes, world_size)
            slots[engine] = (desc, slot_bytes, HEADER_BYTES + rank * slot_bytes)
        if self.missing_patch_region or not config.enabled:
            self.verifier = None  # full updates only: nothing of delta mode to verify
        self.snapshot: Snapshot | None = None
        self._staging: torch.Tensor | None = None
        self._staging_region: Any = None
        self.slots: dict[str, _Slot] = {}
        if config.enabled and not self.missing_patch_region:
            self._allocate(slots, world_size)
        elif config.enabled:
            log.warning(
                "trainer rank %d: engine(s) %s have no patch region "
                "(ReceiverConfig.patch_region_bytes): full updates only",
                rank,
                ", ".join(self.missing_patch_region[:5]),
            )
        self.mode = FULL
        self.reason = "first update"
        self._updates_since_full = 0
        self._last_wire_fraction = 0.0
        self.speed = SpeedGuard(
            enabled=config.full_when_slower, retry_after=config.retry_delta_after_updates
        )
        self._await_applied: tuple[int, list[str]] | None = None
        self._invalid_because = "the last full update failed"
        """Why the snapshot is invalid (after its first full update committed)."""
        self._failed_apply: set[str] = set()
        self._overflowed = False
        self._encode_s = 0.0
        self._apply_wait_s = 0.0

    # -- memory -------------------------------------------------------------------------------

    def _allocate(self, slots: Mapping[str, tuple[RegionDescriptor, int, int]], world: int) -> None:
        cfg = self.config
        on_device = self.device.type == "cuda" and (
            cfg.snapshot_memory == "device"
            or (
                cfg.snapshot_memory == "auto"
                and self.full_bytes <= cfg.snapshot_device_budget_bytes
            )
        )
        snap_device = self.device if on_device else torch.device("cpu")
        self.snapshot = Snapshot(
            self.full_bytes, snap_device, pin=self.device.type == "cuda" and not on_device
        )
        # Staging per engine: its region header, then this rank's slot.
        total = sum(HEADER_BYTES + slot_bytes for _, slot_bytes, _ in slots.values())
        self._staging = torch.zeros(total, dtype=torch.uint8, device=self.device)
        at = 0
        for engine, (desc, slot_bytes, slot_offset) in sorted(slots.items()):
            self._staging[at : at + HEADER_BYTES].copy_(region_header(world, slot_bytes))
            builder = PatchBuilder(
                self._staging[at + HEADER_BYTES : at + HEADER_BYTES + slot_bytes]
            )
            self.slots[engine] = _Slot(engine, desc, slot_offset, builder, at)
            at += HEADER_BYTES + slot_bytes
        self._staging_region = self.transport.register(self._staging, role=RegionRole.SOURCE)
        log.info(
            "trainer rank %d: delta mode, snapshot %.3f GB on %s, patch staging %.3f GB",
            self.rank,
            self.full_bytes / 1e9,
            snap_device,
            total / 1e9,
        )
        if self.device.type == "cuda" and not on_device:
            log.warning(
                "trainer rank %d: delta snapshot in pinned host memory (delta.snapshot_memory="
                "%r, snapshot_device_budget_bytes=%d): every update moves its %.3f GB over PCIe "
                "(a delta reads it to compare, a full update writes it), so a delta is no faster "
                "than a full update over links as fast as PCIe; snapshot_memory='device' keeps it "
                "on the GPU (docs/delta.md, Memory)",
                self.rank,
                cfg.snapshot_memory,
                cfg.snapshot_device_budget_bytes,
                self.full_bytes / 1e9,
            )

    def close(self) -> None:
        """Deregister the patch staging (the snapshot is plain memory)."""
        if self._staging_region is not None:
            self.transport.deregister(self._staging_region)
            self._staging_region = None

    # -- per update ---------------------------------------------------------------------------

    def begin(self, step: int, deadline: float) -> None:
        """Decide this update's mode and wait until the engines applied the last delta; with
        `verify`, judge the last update first and ask for this one's digests."""
        self._encode_s = 0.0
        self._apply_wait_s = 0.0
        for s in self.slots.values():
            s.builder.reset()
        self._wait_applied(deadline)
        if self.verifier is not None:
            try:
                self.verifier.judge(deadline)
            except WeightTransferError:
                if self.snapshot is not None:
                    self.snapshot.valid = False  # the next update rewrites every byte
                raise
            self.verifier.request(step)
        cfg = self.config
        snap = self.snapshot
        if not cfg.enabled:
            self.mode, self.reason = FULL, "delta mode off"
        elif self.missing_patch_region:
            self.mode, self.reason = FULL, "an engine has no patch region"
        elif snap is None or not snap.valid:
            self.mode, self.reason = (
                FULL,
                ("first update" if snap is None or snap.step == 0 else self._invalid_because),
            )
        elif self._overflowed:
            self.mode, self.reason = FULL, "the last delta failed in the delta layer"
        elif self._failed_apply:
            self.mode = FULL
            self.reason = (
                f"engine(s) {sorted(self._failed_apply)[:3]} did not apply the last update "
                "(or did not say so in time)"
            )
        elif cfg.anchor_every_updates and self._updates_since_full >= cfg.anchor_every_updates:
            self.mode, self.reason = FULL, f"anchor (every {cfg.anchor_every_updates} updates)"
        elif self._last_wire_fraction > cfg.max_wire_fraction:
            self.mode = FULL
            self.reason = f"dense: the last delta was {self._last_wire_fraction:.2f} of full"
        elif (slower := self.speed.reason_for_full()) is not None:
            self.mode, self.reason = FULL, slower
        else:
            self.mode, self.reason = DELTA, "delta"
        self._overflowed = False
        if self.mode == FULL and snap is not None:
            snap.valid = False
            self._invalid_because = "the last full update failed"
            # The runs' places in the snapshot are laid out anew by every full update.
            self._offsets = {}
            self._next_offset = 0  # becomes valid again when this full update commits
            self._layout_gen += 1

    def _wait_applied(self, deadline: float) -> None:
        """Bounded wait until every engine sent the last committed delta acknowledged it.

        Whatever happens, the wait is over after this call: an engine that did not answer (or
        whose answer cannot be read) fails this update, with nothing written, and gets a full
        update next, so a missed acknowledgement costs one update and never wedges delta mode.
        """
        if self._await_applied is None:
            return
        step, engines = self._await_applied
        self._await_applied = None
        t0 = time.perf_counter()
        until = min(deadline, time.monotonic() + self.config.apply_timeout_s)
        keys = {e: applied_key(step, e) for e in engines}
        try:
            self.control.wait(list(keys.values()), max(0.001, until - time.monotonic()))
        except WeightTransferError as exc:
            try:
                missing = [e for e, k in keys.items() if not self.control.exists(k)]
            except WeightTransferError:
                missing = list(engines)
            self._failed_apply = set(missing) or set(engines)
            if not isinstance(exc, TransportTimeoutError):
                raise
            raise TransportTimeoutError(
                f"trainer rank {self.rank}: engine(s) {missing[:5]} did not apply delta update "
                f"{step} within {self.config.apply_timeout_s:.1f} s (the engine calls "
                "WeightReceiver.apply_delta once per update); nothing was written, and the "
                "next update is full"
            ) from exc
        self._failed_apply = set()
        for e, k in keys.items():
            try:
                d = self.control.get(k, Decision)
            except WeightTransferError as exc:
                d = Decision(step=step, ok=False, error=f"engine {e!r}'s acknowledgement: {exc}")
            if not d.ok:
                log.warning("trainer rank %d: %s", self.rank, d.error)
                self._failed_apply.add(e)
        self._apply_wait_s = time.perf_counter() - t0

    def intercepts(self, ops: Sequence[WriteOp]) -> bool:
        """Whether these writes go through the delta layer (weights, while delta mode is on)."""
        if self.snapshot is None or not ops:
            return False
        return id(ops[0].target) not in self._version_descs

    def _where(self, peer: str, op: WriteOp) -> tuple[int, int, int]:
        """(engine region index, snapshot offset, element size) of a write."""
        hit = self._region_index.get(id(op.target))
        if hit is None:
            raise WeightTransferError(
                f"trainer rank {self.rank}: a write to {peer!r} targets a region of no known "
                "descriptor (delta mode)"
            )
        _, region = hit
        key = (peer, region, op.target_offset, op.nbytes)
        at = self._offsets.get(key)
        if at is None:
            if self.mode == DELTA:
                self._overflowed = True  # the next update is full and lays the runs out anew
                raise WeightTransferError(
                    f"trainer rank {self.rank}: delta update wrote a run the snapshot does not "
                    f"hold ({peer!r} region {region} offset {op.target_offset})"
                )
            at = self._offsets[key] = self._next_offset
            self._next_offset += op.nbytes
            assert self._next_offset <= self.full_bytes, "snapshot smaller than the writes"
        return region, at, self._sizes.of(peer, region, op.target_offset, op.nbytes)

    def _columns(self, peer: str, ops: Sequence[WriteOp], cache: dict[str, Any] | None) -> _Columns:
        """The batch's per-write columns (`_where` of every write); kept in `cache` (a prepared
        batch's state) while the snapshot's layout holds, so a batch posted every update costs
        no per-write Python after its first full update."""
        if cache is not None:
            hit = cache.get("delta")
            if hit is not None and hit[0] == self._layout_gen:
                return cast(_Columns, hit[1])
        sources: dict[int, int] = {}
        regions: list[Any] = []
        rows = []
        for op in ops:
            region, at, size = self._where(peer, op)
            k = sources.setdefault(id(op.source), len(regions))
            if k == len(regions):
                regions.append(op.source)
            rows.append((k, op.source_offset, at, op.nbytes, size, region, op.target_offset))
        t = np.array(rows, dtype=np.int64).reshape(-1, 7)
        cols = _Columns(
            sources=tuple(regions),
            source=t[:, 0],
            source_offset=t[:, 1],
            snapshot_offset=t[:, 2],
            nbytes=t[:, 3],
            esize=t[:, 4],
            region=t[:, 5],
            dest=t[:, 6],
        )
        if cache is not None:
            cache["delta"] = (self._layout_gen, cols)
        return cols

    def take(
        self, peer: str, ops: Sequence[WriteOp], cache: dict[str, Any] | None = None
    ) -> WriteHandle | None:
        """The delta layer's part of posting `ops` to `peer` (see `DeltaTransport`): in a full
        update the bytes are copied into the snapshot and None is returned (the caller posts
        them); in a delta they are encoded and a completed handle is returned."""
        snap = self.snapshot
        assert snap is not None
        if self.mode == FULL:
            cols = self._columns(peer, ops, cache)
            _copy_into(snap.buffer, cols.snapshot_offset, cols.source_ptr(), cols.nbytes, ops)
            self._sync(ops)
            return None
        t0 = time.perf_counter()
        builder = self.slots[peer].builder
        cols = self._columns(peer, ops, cache)
        first = ops[0].source.tensor
        try:
            if snap.buffer.device == first.device and uses_triton(first):
                # Every run of the batch counted and encoded by table kernels from addresses,
                # one synchronization (PatchBuilder.add_table).
                builder.add_table(
                    first.device,
                    cols.source_ptr(),
                    snap.buffer.data_ptr() + cols.snapshot_offset,
                    cols.nbytes // cols.esize,
                    cols.esize,
                    cols.region,
                    cols.dest,
                    cols.snapshot_offset,
                    lambda i: _int_run(ops[i], int(cols.esize[i])),
                )
            else:
                # A host snapshot of device runs (brought over run by run), or the CPU path.
                runs = []
                for i, op in enumerate(ops):
                    size, at = int(cols.esize[i]), int(cols.snapshot_offset[i])
                    src = _int_run(op, size)
                    old = snap.buffer[at : at + op.nbytes].view(src.dtype)
                    if old.device != src.device:
                        old = old.to(src.device, non_blocking=True)
                    runs.append((src, old, int(cols.region[i]), op.target_offset, at))
                builder.add_runs(runs)
        except PatchError:
            self._overflowed = True  # this update fails; the next one is full
            raise
        # The pipeline frees the staging these bytes came from once the handle is done.
        self._sync(ops)
        self._encode_s += time.perf_counter() - t0
        return WriteHandle(
            handle_id=-1,
            peer=peer,
            num_ops=len(ops),
            nbytes=int(cols.nbytes.sum()),
            posted_at=time.monotonic(),
            done=True,
            state="encoded",
        )

    def _sync(self, ops: Sequence[WriteOp]) -> None:
        """Wait for the copies/kernels just queued on the device of `ops`' sources."""
        t = ops[0].source.tensor
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    def post_patches(self, step: int, deadline: float) -> int:
        """Delta: write every engine's region header and this rank's slot; wait until they
        completed. Returns the patch bytes written."""
        if self.mode != DELTA:
            return 0
        base = self.snapshot.step if self.snapshot is not None else 0
        handles = []
        total = 0
        for engine, s in sorted(self.slots.items()):
            n = s.builder.finish(step=step, base_step=base, rank=self.rank)
            slot_at = s.header_at + HEADER_BYTES
            ops = [
                WriteOp(self._staging_region, s.header_at, s.descriptor, 0, HEADER_BYTES),
                WriteOp(self._staging_region, slot_at, s.descriptor, s.slot_offset, n),
            ]
            handles.append(self.transport.post_writes(engine, ops))
            total += n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for h in handles:
            self.transport.wait(h, max(0.001, deadline - time.monotonic()))
        return total

    def stats(self, wire_bytes: int) -> DeltaStats:
        """This update's `DeltaStats` (`wire_bytes`: the patches in a delta, else full)."""
        return DeltaStats(
            mode=self.mode,
            reason=self.reason,
            wire_bytes=wire_bytes if self.mode == DELTA else self.full_bytes,
            full_bytes=self.full_bytes,
            num_segments=sum(s.builder.num_segments for s in self.slots.values())
            if self.mode == DELTA
            else 0,
            encode_s=self._encode_s,
            apply_wait_s=self._apply_wait_s,
        )

    def committed(self, step: int, wire_bytes: int, seconds: float = 0.0) -> None:
        """The update committed (`seconds`: the whole update call on this rank): advance the
        snapshot (delta) or mark it valid (full)."""
        if seconds > 0:
            self.speed.record(self.mode, seconds)
        snap = self.snapshot
        if snap is None:
            return
        if self.mode == DELTA:
            for s in self.slots.values():
                snap.advance(s.builder)
            self._updates_since_full += 1
            self._last_wire_fraction = wire_bytes / max(1, self.full_bytes)
        else:
            self._updates_since_full = 0
            self._last_wire_fraction = 0.0
        if snap.buffer.is_cuda or self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        snap.valid = True
        snap.step = step
        # Every engine applies each update (a full one too, as a no-op) and says so.
        self._await_applied = (step, sorted(self.slots))
        if self.verifier is not None:
            self.verifier.publish(
                step,
                sorted(self.slots),
                [
                    (peer, region, offset, snap.buffer[at : at + nbytes])
                    for (peer, region, offset, nbytes), at in self._offsets.items()
                ],
            )

    def outcome_unknown(self) -> None:
        """This rank could not read the update's verdict: the engines may or may not hold it,
        so the snapshot says nothing about them any more and the next update is full."""
        self.failed()
        if self.snapshot is not None:
            self.snapshot.valid = False
            self._invalid_because = "this rank could not read the last update's verdict"

    def failed(self) -> None:
        """The update failed: a delta leaves everything as it was; after a full one the
        snapshot is invalid (the engines hold unknown bytes), so the next update is full.
        (The snapshot is already marked invalid while a full update runs.)"""
        for s in self.slots.values():
            s.builder.reset()
