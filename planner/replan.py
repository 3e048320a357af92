"""Re-planning for the same trainers: reuse the last schedule where the engines' layouts did not
change.

An engine that restarts and joins again (`WeightReceiver(..., rejoin=True)`) usually brings
the same tensors and recipes at new places: new registered regions (descriptors), possibly
another host, tensors at other offsets. Nothing the planner decides (which rank sends which
piece, how writes are batched into tasks, in which order) depends on where an engine's tensors
sit, only the write runs into that engine do. `Replanner.plan` therefore checks the new
placement of such an engine, rewrites the runs of the writes into it, rebuilds only the tasks
that hold such writes, and reuses every other task object of the last schedule. The result is
equal, field for field, to `plan` on the same inputs (tests check that); any other change (an
engine added or removed, a recipe or shape that differs, another config) plans from scratch.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import operator
from collections.abc import Sequence

from weight_transfer.errors import PlanMismatchError
from weight_transfer.planner.plan import (
    PlannerConfig,
    _check_placement,
    _finish_fingerprint,
    _hash_sources,
    _plan,
)
from weight_transfer.planner.types import (
    DestManifest,
    QuantWrite,
    Schedule,
    SliceWrite,
    SourceManifest,
    Task,
    WriteRun,
)

_Place = tuple[int, int]  # (region, offset_bytes) of an engine tensor
_engine_of = operator.attrgetter("engine")


@dataclasses.dataclass(slots=True)
class _Last:
    """The last plan made, and where each engine's writes sit in it."""

    dests: dict[str, DestManifest]
    schedule: Schedule
    # engine -> (rank, task index) of every task holding a write into that engine, built on
    # the first re-plan that needs it.
    tasks_of: dict[str, list[tuple[int, int]]] | None = None


class Replanner:
    """Plans for one set of trainer manifests, again and again as the engines change.

    Not thread-safe; pure otherwise (no I/O, no clocks). Keeps the last schedule and its
    engine manifests (and the hash state of the trainer manifests, so a re-plan does not hash
    10^6 trainer entries again).

    Args:
        sources: the trainer ranks' manifests; they must not change while this object is used
            (a changed trainer side needs a new `Replanner`).
        config: planner configuration of every plan made.
    """

    def __init__(
        self, sources: Sequence[SourceManifest], config: PlannerConfig | None = None
    ) -> None:
        self._sources = tuple(sources)
        self._config = config or PlannerConfig()
        self._source_hash: hashlib._Hash | None = None
        self._memo: dict[int, tuple[object, bytes]] = {}
        self._last: _Last | None = None
        self.reused_last = False
        """Whether the latest `plan` call reused the schedule before it (for logs and tests)."""

    def plan(self, dests: Sequence[DestManifest]) -> Schedule:
        """The schedule for `dests`: equal to `planner.plan.plan(sources, dests, config)`.

        Reuses the previous schedule when `dests` names the same engines and each engine that
        differs from the last plan's differs only in where its tensors sit (regions, offsets,
        descriptors, host, version word); plans from scratch otherwise.

        Raises:
            PlanMismatchError: listing every problem found in the manifests.
        """
        # As `plan` does: the collector's scans of 10^6 new acyclic objects cost more than
        # the planning itself.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._plan(dests)
        finally:
            if enabled:
                gc.enable()

    def _plan(self, dests: Sequence[DestManifest]) -> Schedule:
        if self._source_hash is None:
            self._source_hash = _hash_sources(self._sources)
        by_name = {d.engine: d for d in dests}
        last = self._last
        self.reused_last = False
        if last is not None and len(by_name) == len(dests) and by_name.keys() == last.dests.keys():
            changed = [e for e, d in by_name.items() if d is not last.dests[e]]
            if all(_same_layout(last.dests[e], by_name[e]) for e in changed):
                schedule = self._rewrite(last, by_name, changed)
                self._remember(by_name, schedule, last)
                self.reused_last = True
                return schedule
        self._memo.clear()
        schedule = _plan(self._sources, dests, self._config, self._source_hash, self._memo)
        self._remember(by_name, schedule, None)
        return schedule

    def _remember(
        self, dests: dict[str, DestManifest], schedule: Schedule, last: _Last | None
    ) -> None:
        tasks_of = last.tasks_of if last is not None else None
        self._last = _Last(dict(dests), schedule, tasks_of)
        # Only the memo entries of manifests still in use stay (the rest would pin old tuples).
        keep = {id(d.tensors) for d in dests.values()} | {id(d.recipes) for d in dests.values()}
        for k in [k for k in self._memo if k not in keep]:
            del self._memo[k]

    def _rewrite(self, last: _Last, dests: dict[str, DestManifest], changed: list[str]) -> Schedule:
        problems: list[str] = []
        moves: dict[str, dict[str, tuple[_Place, _Place]]] = {}
        for e in changed:
            new = dests[e]
            _check_placement(new, problems)
            old_at = {t.name: (t.region, t.offset_bytes) for t in last.dests[e].tensors}
            moves[e] = {
                t.name: (old_at[t.name], (t.region, t.offset_bytes))
                for t in new.tensors
                if old_at[t.name] != (t.region, t.offset_bytes)
            }
        if problems:
            raise PlanMismatchError(problems)
        prev = last.schedule
        assert self._source_hash is not None
        fp = _finish_fingerprint(
            self._source_hash.copy(), list(dests.values()), self._config, self._memo
        )
        moved = {e: m for e, m in moves.items() if m}
        if not moved:
            return dataclasses.replace(prev, fingerprint=fp)
        if last.tasks_of is None:
            last.tasks_of = _tasks_by_engine(prev)
        touched: dict[int, dict[int, Task]] = {}
        for e, m in moved.items():
            for rank, i in last.tasks_of.get(e, ()):
                tasks = touched.setdefault(rank, {})
                task = tasks.get(i, prev.ranks[rank].tasks[i])
                tasks[i] = dataclasses.replace(
                    task, writes=tuple(_moved(w, m) if w.engine == e else w for w in task.writes)
                )
        ranks = list(prev.ranks)
        for rank, tasks in touched.items():
            rs = ranks[rank]
            new_tasks = list(rs.tasks)
            for i, t in tasks.items():
                new_tasks[i] = t
            ranks[rank] = dataclasses.replace(rs, tasks=tuple(new_tasks))
        return dataclasses.replace(prev, fingerprint=fp, ranks=tuple(ranks))


def _same_layout(old: DestManifest, new: DestManifest) -> bool:
    """Equal tensors (names, shapes, dtypes, in order) and recipes: only placement may differ."""
    if old.recipes is not new.recipes and old.recipes != new.recipes:
        return False
    if len(old.tensors) != len(new.tensors):
        return False
    return all(
        a.name == b.name and a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(old.tensors, new.tensors, strict=True)
    )


def _tasks_by_engine(schedule: Schedule) -> dict[str, list[tuple[int, int]]]:
    """engine -> (rank, task index) of every task with a write into it."""
    out: dict[str, list[tuple[int, int]]] = {}
    for rs in schedule.ranks:
        for i, t in enumerate(rs.tasks):
            for e in set(map(_engine_of, t.writes)):
                out.setdefault(e, []).append((rs.rank, i))
    return out


def _shift(runs: tuple[WriteRun, ...], move: tuple[_Place, _Place] | None) -> tuple[WriteRun, ...]:
    if move is None:
        return runs
    (_, old_off), (region, new_off) = move
    return tuple(WriteRun(region, r.offset_bytes - old_off + new_off, r.nbytes) for r in runs)


def _moved(
    w: SliceWrite | QuantWrite, moves: dict[str, tuple[_Place, _Place]]
) -> SliceWrite | QuantWrite:
    """`w` with its runs at the engine's new tensor places."""
    if isinstance(w, SliceWrite):
        m = moves.get(w.dest)
        return w if m is None else dataclasses.replace(w, runs=_shift(w.runs, m))
    mw, ms = moves.get(w.dest), moves.get(w.scale_dest)
    if mw is None and ms is None:
        return w
    return dataclasses.replace(
        w, weight_runs=_shift(w.weight_runs, mw), scale_runs=_shift(w.scale_runs, ms)
    )


__all__ = ["Replanner"]
