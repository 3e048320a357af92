"""What the stages of one update hand each other: a prepared task, its posted batches, and the
write loop's bookkeeping."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from typing import Any

from weight_transfer.backends.base import WriteHandle, WriteOp
from weight_transfer.pipeline.records import TaskRecord
from weight_transfer.planner.types import Task

CANCEL_POLL_S = 0.02
"""How often the write loop asks whether another rank failed."""


@dataclasses.dataclass(slots=True)
class Prepared:
    """A task whose bytes are ready (or being made ready on the device, until `event`)."""

    task: Task
    record: TaskRecord
    ops: dict[str, list[WriteOp]]
    """Its writes, per engine."""
    blocks: list[tuple[int, int]]
    """Staging arena blocks (offset, bytes) it holds."""
    scratch: int
    """Scratch bytes it was admitted with."""
    event: Any = None
    """torch.cuda.Event recorded after its device work; None off CUDA."""
    ring: bool = False
    """It holds its graph group's slice of the arena (`Staging.claim_slice`), not blocks."""


@dataclasses.dataclass(slots=True)
class InFlight:
    """Posted batches of one prepared task (or of a group of static tasks)."""

    prepared: Prepared
    handles: list[WriteHandle]
    records: list[TaskRecord]
    """Every task record these batches complete."""


@dataclasses.dataclass(slots=True)
class RunState:
    """What one update's write loop tracks."""

    step: int
    t0: float
    deadline: float
    timeout_s: float
    ready: queue.Queue[Prepared | BaseException | None]
    """Prepared tasks from the prepare stage; an exception it hit; None after the last."""
    abort: threading.Event
    records: list[TaskRecord] = dataclasses.field(default_factory=list)
    in_flight: list[InFlight] = dataclasses.field(default_factory=list)
    waiting: list[Prepared] = dataclasses.field(default_factory=list)
    finished_preparing: bool = False
    total: int = 0
    num_writes: int = 0
    post_seconds: float = 0.0
    """Host time spent in the transport's post calls."""
    cancelled: Callable[[], str | None] | None = None
    """Polled about every `CANCEL_POLL_S`: a message once another rank failed."""
    next_poll: float = 0.0
