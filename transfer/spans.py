"""Named spans of an update on the host's monotonic clock, as Chrome/Perfetto trace events.

Every process of one host reads the same clock (`time.monotonic_ns`, CLOCK_MONOTONIC on
Linux), so the spans a trainer process and an engine worker process record can be put into
one trace file as they are (`write_trace`) and line up: the phases of one update, both sides,
on one timeline (open it in ui.perfetto.dev). Recording is two clock reads and one append to a
bounded deque per span; nothing is written anywhere until asked.

Not thread-safe beyond what `collections.deque.append` is (atomic in CPython): spans may be
recorded from several threads of one process; `events` copies the deque first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Span", "SpanLog", "now_ns", "write_trace"]


def now_ns() -> int:
    """The clock every span uses: CLOCK_MONOTONIC, shared by the processes of one host."""
    return time.monotonic_ns()


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One timed phase."""

    name: str
    start_ns: int
    end_ns: int
    thread: str
    step: int | None = None

    @property
    def seconds(self) -> float:
        """Duration."""
        return (self.end_ns - self.start_ns) / 1e9


class SpanLog:
    """The recent spans of one process (at most `max_spans`, oldest dropped)."""

    def __init__(self, process: str, *, max_spans: int = 4096) -> None:
        """Args: process: the name the trace shows for this process ("trainer rank 0")."""
        if max_spans < 1:
            raise ValueError("max_spans must be positive")
        self.process = process
        self._spans: deque[Span] = deque(maxlen=max_spans)

    def add(self, name: str, start_ns: int, end_ns: int, step: int | None = None) -> None:
        """Record a span measured by the caller (times from `now_ns`)."""
        self._spans.append(Span(name, start_ns, end_ns, threading.current_thread().name, step))

    @contextlib.contextmanager
    def span(self, name: str, step: int | None = None) -> Iterator[None]:
        """Record the time the `with` body takes (also when it raises)."""
        t0 = now_ns()
        try:
            yield
        finally:
            self.add(name, t0, now_ns(), step)

    def spans(self, step: int | None = None) -> list[Span]:
        """The recorded spans (of update `step` only, if given), oldest first."""
        return [s for s in list(self._spans) if step is None or s.step == step]

    def clear(self) -> None:
        """Forget every span."""
        self._spans.clear()

    def events(self) -> list[dict[str, Any]]:
        """Chrome trace events ("X" complete events, microseconds on the shared clock), with
        this process's and its threads' names."""
        pid = os.getpid()
        spans = list(self._spans)
        tids: dict[str, int] = {}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": self.process}}
        ]
        for s in spans:
            tid = tids.setdefault(s.thread, len(tids) + 1)
            args: dict[str, Any] = {} if s.step is None else {"step": s.step}
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": pid,
                    "tid": tid,
                    "ts": s.start_ns / 1e3,
                    "dur": (s.end_ns - s.start_ns) / 1e3,
                    "args": args,
                }
            )
        for thread, tid in tids.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}
            )
        return events


def write_trace(path: str | Path, *event_lists: Sequence[dict[str, Any]]) -> None:
    """Write the events of several processes (`SpanLog.events` of each) as one trace file."""
    merged: Iterable[dict[str, Any]] = (e for events in event_lists for e in events)
    Path(path).write_text(json.dumps({"traceEvents": list(merged), "displayTimeUnit": "ms"}))
