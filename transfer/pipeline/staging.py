"""Temporary memory of one rank: a registered staging arena handed out first-fit, the scratch
budget tasks are admitted under, and the fixed arena slices that graph groups reuse (a ring).

The prepare stage takes memory, the write stage gives it back once a task's writes completed;
both run on their own threads, so everything here is thread-safe.
"""

from __future__ import annotations

import threading
import time

import torch

from weight_transfer.backends.base import (
    Region,
    RegionRole,
    Transport,
    TransportTimeoutError,
    WeightTransferError,
)
from weight_transfer.pipeline.geometry import ALIGN, round_up
from weight_transfer.pipeline.state import Prepared
from weight_transfer.planner.types import Task


class StagingArena:
    """A fixed block of registered memory handed out first-fit; thread-safe."""

    def __init__(self, transport: Transport, nbytes: int, device: torch.device) -> None:
        self.nbytes = max(ALIGN, nbytes)
        if device.type == "cuda":
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        else:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        # Touch every page now so the first update does not pay page faults.
        self.buffer.fill_(0)
        self.region: Region = transport.register(self.buffer, role=RegionRole.SOURCE)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]
        self._cond = threading.Condition()
        self.in_use = 0
        self.peak = 0

    def try_alloc(self, nbytes: int) -> int | None:
        """Offset of a free block of `nbytes` (aligned), or None if none fits now."""
        need = round_up(max(nbytes, 1))
        with self._cond:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + need, size - need)
                    self.in_use += need
                    self.peak = max(self.peak, self.in_use)
                    return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a block."""
        need = round_up(max(nbytes, 1))
        with self._cond:
            self._free.append((offset, need))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            self._free = merged
            self.in_use -= need
            self._cond.notify_all()

    def wait_change(self, timeout_s: float) -> None:
        """Sleep until a block is freed or the timeout passes."""
        with self._cond:
            self._cond.wait(timeout_s)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 slice of the arena at `offset`."""
        return self.buffer[offset : offset + nbytes]


class Staging:
    """Who holds which temporary memory: arena blocks, scratch bytes and ring slices."""

    def __init__(self, arena: StagingArena, scratch_budget: int, rank: int) -> None:
        self.arena = arena
        self.scratch_budget = scratch_budget
        """Unregistered temporary bytes (gathers, assembly) tasks in flight may hold."""
        self.rank = rank
        self.scratch_in_use = 0
        self.scratch_peak = 0
        self._lock = threading.Lock()
        self._ring_busy: list[tuple[int, int, int]] = []  # (task_id, start, end) in flight
        self._ring_cond = threading.Condition()

    def reset_peaks(self) -> None:
        """Start the peaks of a new update at what is held now (quarantined memory)."""
        self.arena.peak = self.arena.in_use
        self.scratch_peak = self.scratch_in_use

    def admit(self, task: Task, deadline: float, abort: threading.Event) -> bool:
        """Reserve the task's scratch bytes within the budget (a task alone may use it all).

        Returns False if `abort` was set while waiting. Raises `TransportTimeoutError` past the
        deadline.
        """
        while True:
            with self._lock:
                if (
                    self.scratch_in_use == 0
                    or self.scratch_in_use + task.scratch_bytes <= self.scratch_budget
                ):
                    self.scratch_in_use += task.scratch_bytes
                    self.scratch_peak = max(self.scratch_peak, self.scratch_in_use)
                    return True
            if abort.is_set():
                return False
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"trainer rank {self.rank}: task {task.task_id} never admitted"
                )
            self.arena.wait_change(0.01)

    def release_scratch(self, nbytes: int) -> None:
        """Give back scratch bytes reserved by `admit`."""
        with self._lock:
            self.scratch_in_use -= nbytes

    def alloc(
        self, nbytes: int, blocks: list[tuple[int, int]], deadline: float, abort: threading.Event
    ) -> int:
        """Offset of an arena block of `nbytes`, recorded in `blocks`; waits for one to be freed.

        Raises `WeightTransferError` if `abort` is set meanwhile, `TransportTimeoutError` past
        the deadline.
        """
        while True:
            off = self.arena.try_alloc(nbytes)
            if off is not None:
                blocks.append((off, nbytes))
                return off
            if abort.is_set():
                raise WeightTransferError("update aborted")
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"trainer rank {self.rank}: no staging memory for {nbytes} bytes before the "
                    "deadline"
                )
            self.arena.wait_change(0.01)

    def free_blocks(self, blocks: list[tuple[int, int]]) -> None:
        """Return arena blocks."""
        for off, n in blocks:
            self.arena.free(off, n)

    def claim_slice(
        self, task: Task, start: int, end: int, deadline: float, abort: threading.Event
    ) -> bool:
        """Take the arena slice [start, end) for `task` once no task in flight owns any byte of
        it. Returns False if `abort` was set while waiting; raises past the deadline."""
        with self._ring_cond:
            while any(a < end and start < b for _, a, b in self._ring_busy):
                if abort.is_set():
                    return False
                if time.monotonic() > deadline:
                    raise TransportTimeoutError(
                        f"trainer rank {self.rank}: task {task.task_id} never got its staging slice"
                    )
                self._ring_cond.wait(0.01)
            self._ring_busy.append((task.task_id, start, end))
        return True

    def release(self, p: Prepared) -> None:
        """Give back everything a prepared task holds (its writes no longer read it)."""
        if p.ring:
            with self._ring_cond:
                self._ring_busy = [b for b in self._ring_busy if b[0] != p.task.task_id]
                self._ring_cond.notify_all()
            return
        self.free_blocks(p.blocks)
        p.blocks = []
        self.release_scratch(p.scratch)
        p.scratch = 0
