"""What an update reports: per-task stage times, the rank's totals, and a Perfetto trace of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the delta layer imports the pipeline's package, not the other way round
    from weight_transfer.delta.session import DeltaStats


@dataclasses.dataclass(slots=True)
class TaskRecord:
    """Stage times of one task in one update (seconds since the update started)."""

    task_id: int
    kind: str
    nbytes: int
    admit: float = 0.0
    prepare_start: float = 0.0
    prepare_end: float = 0.0
    write_start: float = 0.0
    write_end: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class UpdatePhases:
    """Seconds of the steps `WeightSender.update` takes around the executor, in order."""

    go_s: float
    """Waiting for the controller's "go" (or sending it, on the rank hosting the controller)."""
    done_s: float
    """Every rank's report and the commit verdict."""
    versions_s: float
    """Writing the version words."""
    result_s: float
    """The committed reports and the result engines confirm from."""


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateStats:
    """What one update did on one rank."""

    step: int
    seconds: float
    nbytes: int
    num_tasks: int
    peak_staging_bytes: int
    peak_scratch_bytes: int
    records: tuple[TaskRecord, ...]
    num_writes: int = 0
    """Write ops posted (before any coalescing by the transport)."""
    post_seconds: float = 0.0
    """Host time the write stage spent posting (the prepare stage's host time is in records)."""
    phases: UpdatePhases | None = None
    """The sender's steps around the executor (None from `Executor.run` alone)."""
    delta: DeltaStats | None = None
    """Delta mode's decision and bytes for this update (`SenderConfig.delta`); None when off."""


def trace_events(
    records: Sequence[TaskRecord], *, rank: int, step: int, start_s: float = 0.0
) -> list[dict[str, Any]]:
    """Chrome/Perfetto trace events ("X" complete events, microseconds) for one update.

    `start_s` is when the update started on the caller's timeline (record times count from it),
    so the events of successive updates follow one another instead of overlapping.
    """
    events: list[dict[str, Any]] = []
    for r in records:
        for stage, a, b in (
            ("prepare", r.prepare_start, r.prepare_end),
            ("write", r.write_start, r.write_end),
        ):
            if b > a:
                events.append(
                    {
                        "name": f"task {r.task_id} ({r.kind})",
                        "cat": stage,
                        "ph": "X",
                        "ts": (start_s + a) * 1e6,
                        "dur": (b - a) * 1e6,
                        "pid": rank,
                        "tid": stage,
                        "args": {"bytes": r.nbytes, "step": step},
                    }
                )
    return events
