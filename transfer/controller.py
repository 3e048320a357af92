"""The controller: hosts the control plane, plans, runs each update's commit protocol.

It lives in trainer rank 0's process (or any process the deployment chooses). It never touches
weights: it gathers manifests, runs the planner, hands every trainer rank its part of the
schedule, and per update turns the ranks' reports into one decision that every rank raises on,
so an engine's version word advances only after every write into it completed.

Membership can change between updates: an engine that restarted (new memory, new
registrations) joins again with `WeightReceiver(..., rejoin=True)`, engines are added or
removed, and `WeightSender.replan` (collective over the trainer ranks; it calls
`Controller.replan` on the rank hosting the controller) plans again. Each plan is an *epoch*; the
schedules of epoch e > 0 live under `epoch/<e>/`. Update steps keep counting across epochs.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from weight_transfer.backends.base import (
    ConfigurationError,
    ControlPlaneAuthError,
    PlanMismatchError,
    TransportTimeoutError,
    WeightTransferError,
)
from weight_transfer.config import ControllerConfig, ControlPlaneConfig
from weight_transfer.control import ControlPlane
from weight_transfer.planner import codec
from weight_transfer.planner.replan import Replanner
from weight_transfer.planner.types import DestManifest, Schedule, SourceManifest
from weight_transfer.presence import PresenceListener
from weight_transfer.protocol import (
    BarrierRelease,
    Claim,
    Decision,
    Digests,
    Done,
    EngineJoin,
    EnginePeer,
    Failure,
    Go,
    PlanStage,
    PresenceAddress,
    RankPlan,
    Seen,
    TrainerJoin,
    Window,
    window_key,
)

log = logging.getLogger(__name__)

_KEEP_STEPS = 8
"""Per-update keys of the updates older than the last this many decided ones are deleted from
the store (bounded memory, whatever the steps' numbers)."""
_JOIN_SLICE_S = 0.5
"""How often the controller, waiting for engines to join, checks for members refused for their
token (so a token mismatch fails within a second instead of at the timeout)."""


class Phase(str, enum.Enum):
    """The phases the controller arbitrates, named by their report keys.

    DONE: every rank wrote its bytes (its `done/<step>/<rank>` report); the verdict is
    published as `commit/<step>`. COMMITTED: every rank wrote its engines' version words
    (`committed/<step>/<rank>`); the verdict is `result/<step>`. BUILT: every rank built its
    part of re-plan e (`built/<e>/<rank>`); the verdict `switch/<e>` says whether all switch to
    it or all keep the plan they run.
    """

    DONE = "done"
    COMMITTED = "committed"
    BUILT = "built"

    @property
    def verdict_key(self) -> str:
        """Where the controller publishes this phase's verdict."""
        return {"done": "commit", "committed": "result", "built": "switch"}[self.value]


def plan_key(epoch: int, name: str) -> str:
    """Store key of a rank's part of plan `epoch` (`schedule/<rank>`)."""
    return name if epoch == 0 else f"epoch/{epoch}/{name}"


def stage_key(epoch: int, stage: str) -> str:
    """Store key of a planning stage of epoch `epoch` ("started", "result")."""
    return f"plan/{epoch}/{stage}"


def plan_failure(epoch: int, exc: BaseException) -> PlanStage:
    """The failed `result` stage of a plan: a mismatch keeps its list of problems."""
    problems = tuple(exc.problems) if isinstance(exc, PlanMismatchError) else ()
    return PlanStage(epoch=epoch, ok=False, error=str(exc), wait_s=0.0, problems=problems)


class _Janitor:
    """Deletes old store keys on a daemon thread and a connection of its own, so an update
    neither waits for it nor shares a connection with it.

    A failed delete is logged and dropped (the key only costs store memory).
    """

    _CLOSE_TIMEOUT_S = 5.0

    def __init__(self, control: ControlPlane) -> None:
        self._control = control.clone("controller (janitor)")
        self._jobs: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="wt-controller-janitor", daemon=True)
        self._thread.start()

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._jobs.put(keys)

    def _run(self) -> None:
        while True:
            keys = self._jobs.get()
            if keys is None:
                return
            for k in keys:
                try:
                    self._control.delete(k)
                except WeightTransferError as exc:
                    log.debug("controller: could not delete %r: %s", k, exc)
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.set()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every delete queued so far ran; False at the timeout."""
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        """Finish the deletes queued so far (bounded), then stop."""
        self._jobs.put(None)
        self._thread.join(self._CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.info("controller: old store keys still being deleted at close")
        self._control.close()


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """A plan with the joins it was made from (committed by `Controller._adopt`)."""

    epoch: int
    schedule: Schedule
    joins: dict[str, EngineJoin]
    slot_of: dict[str, int]


class Controller:
    """Plans the transfer and arbitrates every update.

    Not thread-safe. Methods block with the control plane's timeout.
    """

    def __init__(self, config: ControllerConfig, control: ControlPlaneConfig) -> None:
        """Host the control plane (in the store's own process: `weight_transfer.store`).

        Raises:
            TransportTimeoutError: the port cannot be bound or the store not started.
        """
        self.config = config
        self.control = ControlPlane(control, server=True, member="controller")
        self.schedule: Schedule | None = None
        self.sources: list[SourceManifest] = []
        # Plans for these sources; a re-plan after an engine rejoined reuses the last schedule.
        self._planner: Replanner | None = None
        self.dests: list[DestManifest] = []
        self.joins: dict[str, EngineJoin] = {}
        self.epoch = 0
        """Number of the newest plan made (0 for the first; `replan` counts up)."""
        self._slot_of: dict[str, int] = {}  # engine -> join slot the current plan uses
        self._latest: dict[str, tuple[int, EngineJoin]] = {}  # engine -> newest join seen
        self._slots_read = 0
        self._live_slots: set[int] = set()
        """Join slots read whose manifest is still in the store (`_forget_slots`)."""
        self._epoch_in_use = 0
        """The epoch of the plan updates run (`epoch` counts plans made, failed ones too)."""
        self._dead_plan_keys: list[str] = []
        """Keys of re-plans that failed or were not switched to: deleted once every rank is
        past them (the next decided update or successful switch)."""
        self._pending: _Plan | None = None  # a re-plan published, not yet switched to
        self._last_committed = 0
        """Last update whose version words were all written (what `close` lingers for)."""
        self._committed_into: dict[str, int] = {}
        """Engine -> last update committed into it (by the join the current plan uses): an
        update window it opened for an update at or before that one is over."""
        self._decided: collections.deque[tuple[int, tuple[str, ...], int]] = collections.deque()
        """(step, engines, mesh groups) of the updates decided, oldest first (`_forget`)."""
        self._extra: dict[int, list[str]] = {}
        """Keys others asked to delete with a step's (`forget_later`)."""
        self._janitor: _Janitor | None = None
        self._gone_lock = threading.Lock()
        self._gone: dict[int, str] = {}
        """Trainer ranks whose presence connection closed: why (names the rank)."""
        self._in_flight: int | None = None
        """The update between `go` and its decision (a rank lost meanwhile fails it)."""
        self._refusals: dict[int, str] = {}
        """Update -> why its `go` tells every rank not to start it (`refuse`)."""
        self._presence: PresenceListener | None = None
        self._presence_control: ControlPlane | None = None
        try:
            # Its own connection: the listener's thread writes while `decide` blocks.
            self._presence_control = self.control.clone("controller (presence)")
            self._presence = PresenceListener(
                self._presence_control,
                control.presence_port,
                config.num_trainer_ranks,
                self._rank_gone,
                self._rank_present,
            )
            self.control.put("presence", PresenceAddress(port=self._presence.port))
        except BaseException:
            self._close_presence()
            self.control.close()
            raise

    # -- planning --------------------------------------------------------------------------

    def _stage(self, epoch: int, stage: str, value: PlanStage) -> None:
        """Publish a planning stage, unless a trainer rank gave up on it first (then raise its
        reason: every rank sees that outcome)."""
        first = self.control.put_first(stage_key(epoch, stage), value, PlanStage)
        if first is not None:
            raise WeightTransferError(first.error)

    def plan(self) -> Schedule:
        """Wait for every trainer rank and engine to join, plan, publish each rank's part.

        Raises:
            PlanMismatchError: the manifests do not fit (also published to every rank).
            TransportTimeoutError: a member did not join in time (names the missing ones).
        """
        cp = self.control
        n, m = self.config.num_trainer_ranks, self.config.num_engines
        t = cp.config.timeout_s
        # Trainer ranks wait for this, then for the result as long as the controller may wait
        # for the joins (trainers, then engines) plus the planning itself.
        self._stage(0, "started", PlanStage(epoch=0, ok=True, error="", wait_s=2 * t))
        try:
            keys = {f"trainer/{r}": r for r in range(n)}
            got = cp.collect(
                list(keys), TrainerJoin, t, accept=lambda k, j: j.manifest.rank == keys[k]
            )
            if got.refused:
                raise ControlPlaneAuthError(
                    f"controller: the join of trainer rank(s) "
                    f"{sorted(keys[k] for k in got.refused)} is not authentic: "
                    + next(iter(got.refused.values()))
                )
            if got.missing:
                raise TransportTimeoutError(
                    f"controller: trainer rank(s) {sorted(keys[k] for k in got.missing)} did not "
                    f"join within {t:.0f} s"
                )
            self.sources = [got.values[f"trainer/{r}"].manifest for r in range(n)]
            self._wait_for_engines(m)
            new = self._plan_for(0, [j for _, j in self._latest.values()])
        except (PlanMismatchError, WeightTransferError) as exc:
            self._stage(0, "result", plan_failure(0, exc))
            raise
        self._publish(new)
        self._adopt(new)
        self._stage(0, "result", PlanStage(epoch=0, ok=True, error="", wait_s=0.0))
        return new.schedule

    def linger_for_plan_error(self, epoch: int, own_rank: int) -> None:
        """After plan `epoch` failed: wait (at most the control-plane timeout) until every other
        trainer rank that joined has read why, so that each raises the same error.

        The store lives in this process; a caller that exits on the error would otherwise take
        it down first, and the other ranks would see only a lost controller.
        """
        cp = self.control
        keys = [
            plan_key(epoch, f"plan_error_seen/{r}")
            for r in range(self.config.num_trainer_ranks)
            if r != own_rank and cp.exists(f"trainer/{r}")
        ]
        if not keys:
            return
        try:
            cp.wait(keys, cp.config.timeout_s)
        except TransportTimeoutError:
            late = [k for k in keys if not cp.exists(k)]
            log.warning("controller: plan %d failed; %s did not read why in time", epoch, late)

    def _wait_for_engines(self, m: int) -> None:
        """Wait for `m` engines to join; fail at once if a member was refused for its token."""
        t = self.control.config.timeout_s
        self._read_joins(
            lambda: len(self._latest) >= m,
            time.monotonic() + t,
            lambda: f"controller: {len(self._latest)} of {m} engines joined within {t:.0f} s",
        )

    def _read_joins(
        self, done: Callable[[], bool], deadline: float, what: Callable[[], str]
    ) -> None:
        """Read join slots in order until `done()`: one blocking wait for each slot's claim.

        A slot whose claim is not sealed in this run (a stranger's) is skipped, not waited on:
        engines skip it too. A slot's join must come from the engine that claimed it.

        Raises:
            ControlPlaneAuthError: a member was refused for its token, or a join is not
                authentic by the deadline.
            TransportTimeoutError: `done()` did not come true by the deadline (`what()`).
        """
        cp = self.control
        while not done():
            i = self._slots_read
            claim = f"claim/engine_slot/{i}"
            remaining = deadline - time.monotonic()
            if not cp.ready([claim], max(0.001, min(_JOIN_SLICE_S, remaining))):
                refused = cp.auth_failures()
                if refused:
                    raise ControlPlaneAuthError(
                        f"controller: {refused} member(s) tried to join with another token; "
                        f"{what()} (every member needs this run's token)"
                    )
                if time.monotonic() >= deadline:
                    raise TransportTimeoutError(what())
                continue
            (raw,) = cp.read_many([claim])
            try:
                owner = codec.from_msgpack(Claim, cp.unseal(cp.full_key(claim), raw)).member
            except (ControlPlaneAuthError, ValueError):
                log.warning("controller: join slot %d was claimed by a stranger; skipped", i)
                self._slots_read = i + 1
                continue
            key = f"engine_slot/{i}"

            def claimed_by(_key: str, j: EngineJoin, owner: str = owner) -> bool:
                return f"engine {j.manifest.engine!r}" == owner

            got = cp.collect(
                [key], EngineJoin, max(0.001, deadline - time.monotonic()), accept=claimed_by
            )
            if key not in got.values:
                if got.refused:
                    raise ControlPlaneAuthError(f"controller: join slot {i}: {got.refused[key]}")
                raise TransportTimeoutError(f"{what()} ({owner} claimed slot {i} but never joined)")
            j = got.values[key]
            self._latest[j.manifest.engine] = (i, j)
            self._live_slots.add(i)
            self._slots_read = i + 1

    def _plan_for(self, epoch: int, joins: Sequence[EngineJoin]) -> _Plan:
        for j in joins:
            if j.transport != joins[0].transport:
                raise WeightTransferError(
                    f"engine {j.manifest.engine!r} uses transport {j.transport!r}, "
                    f"engine {joins[0].manifest.engine!r} uses {joins[0].transport!r}"
                )
        t0 = time.perf_counter()
        if self._planner is None:
            self._planner = Replanner(self.sources, self.config.planner)
        schedule = self._planner.plan([j.manifest for j in joins])
        log.info(
            "plan %d: %d tasks for %d ranks -> %d engines in %.3f s (%s)",
            epoch,
            sum(len(r.tasks) for r in schedule.ranks),
            len(self.sources),
            len(joins),
            time.perf_counter() - t0,
            "last plan reused" if self._planner.reused_last else "planned from scratch",
        )
        by_name = {j.manifest.engine: j for j in joins}
        return _Plan(
            epoch=epoch,
            schedule=schedule,
            joins=by_name,
            slot_of={e: self._latest[e][0] for e in by_name},
        )

    def _adopt(self, new: _Plan) -> None:
        """Make `new` the plan updates run (and the one a later `replan` starts from)."""
        self.schedule = new.schedule
        self.joins = dict(new.joins)
        self.dests = [j.manifest for j in new.joins.values()]
        # An engine that joined anew (a restart) has had no update committed into it yet.
        self._committed_into = {
            e: s
            for e, s in self._committed_into.items()
            if e in new.slot_of and self._slot_of.get(e) == new.slot_of[e]
        }
        self._slot_of = dict(new.slot_of)

    def replan(
        self, *, engines: Sequence[str] | None = None, rejoined: Sequence[str] = ()
    ) -> Schedule:
        """Plan again for a changed set of engines, as the next epoch. Call between updates.

        Normally called through `WeightSender.replan` (collective over the trainer ranks), which
        then builds the new plan on every rank and switches to it only if every rank could
        (`switch`); until then updates run the current plan.

        Args:
            engines: the engines of the new plan (default: those of the current plan). A name
                not in the current plan is an added engine: its join is waited for.
            rejoined: engines that restarted; their join newer than the one the current plan
                used is waited for (a restarted engine joins with `rejoin=True`).

        Raises:
            TransportTimeoutError: an added or restarted engine did not join in time (named).
            PlanMismatchError: the new set of engines does not fit the trainers' tensors.
            ConfigurationError: `engines` is empty or repeats a name, or `rejoined` names an
                engine not in it (also published to every rank).
        """
        names = list(engines) if engines is not None else [d.engine for d in self.dests]
        cp = self.control
        epoch = self.epoch = self.epoch + 1  # a failed plan uses up its number too
        t = cp.config.timeout_s
        self._pending = None
        try:
            self._stage(epoch, "started", PlanStage(epoch=epoch, ok=True, error="", wait_s=t))
        except WeightTransferError:
            self._dead_plan_keys += self._plan_keys(epoch)
            raise
        try:
            # Inside the try: every rank must learn that this plan number failed.
            if not names or len(set(names)) != len(names):
                raise ConfigurationError(f"replan needs distinct engine names, got {names}")
            stray = sorted(set(rejoined) - set(names))
            if stray:
                raise ConfigurationError(
                    f"rejoined engine(s) {stray} are not among the engines {names}"
                )

            def waiting() -> list[str]:
                return [
                    e
                    for e in names
                    if e not in self._latest
                    or (e in rejoined and self._latest[e][0] <= self._slot_of.get(e, -1))
                ]

            self._read_joins(
                lambda: not waiting(),
                time.monotonic() + t,
                lambda: (
                    f"controller: engine(s) {waiting()} did not (re)join within {t:.0f} s "
                    f"for plan {epoch}"
                ),
            )
            new = self._plan_for(epoch, [self._latest[e][1] for e in names])
        except (PlanMismatchError, WeightTransferError) as exc:
            self._dead_plan_keys += self._plan_keys(epoch)
            self._stage(epoch, "result", plan_failure(epoch, exc))
            raise
        self._publish(new)
        self._stage(epoch, "result", PlanStage(epoch=epoch, ok=True, error="", wait_s=0.0))
        self._pending = new
        return new.schedule

    @property
    def newest_schedule(self) -> Schedule | None:
        """The schedule of the newest plan made: a re-plan being built, else the current one."""
        return self._pending.schedule if self._pending is not None else self.schedule

    def switch(self, epoch: int, own: Done, timeout_s: float) -> Decision:
        """Decide whether every rank switches to re-plan `epoch` (all built it) or all keep
        the current plan; adopt it here if so. `own`: the hosting rank's build report."""
        decision = self.decide(epoch, Phase.BUILT, timeout_s, own=own)
        new, self._pending = self._pending, None
        if decision.ok and new is not None and new.epoch == epoch:
            old_epoch = self._epoch_in_use
            self._adopt(new)
            self._epoch_in_use = epoch
            # Every rank read this verdict after every earlier re-plan's: those keys can go.
            self._clean(self._plan_keys(old_epoch) + self._dead_plan_keys)
            self._dead_plan_keys = []
            self._forget_slots()
        else:
            # Other ranks read `switch/<e>` after this: delete once they are past it.
            self._dead_plan_keys += self._plan_keys(epoch)
        return decision

    def _publish(self, new: _Plan) -> None:
        descriptors = {
            e: tuple(r.descriptor for r in sorted(j.manifest.regions, key=lambda r: r.index))
            for e, j in new.joins.items()
        }
        self.control.put_many(
            [
                (
                    plan_key(new.epoch, f"schedule/{rs.rank}"),
                    RankPlan(
                        fingerprint=new.schedule.fingerprint,
                        schedule=rs,
                        engines=tuple(
                            EnginePeer(
                                name=e,
                                endpoint=new.joins[e].endpoint,
                                descriptors=descriptors[e],
                                version_region=new.joins[e].manifest.version_region,
                            )
                            for e in rs.peers
                        ),
                    ),
                )
                for rs in new.schedule.ranks
            ]
        )

    # -- per update ------------------------------------------------------------------------

    def refuse(self, step: int, reason: str) -> None:
        """Have `go(step)` tell every rank not to start update `step`, because of `reason`.

        For the caller that drives the engines and learns, before any byte is written, that
        update `step` cannot run (the vLLM path: a worker was not ready, or vLLM refused
        `start_weight_update`). Its `WeightSender.update(step)` then carries the refusal: every
        rank is told at once and reports the update failed, the verdict names `reason` (one
        line), and engines waiting for `step` hear it. Not thread-safe (as the controller).
        """
        self._refusals = {s: r for s, r in self._refusals.items() if s > step}
        self._refusals[step] = reason

    def go(self, step: int, timeout_s: float | None = None) -> str:
        """Tell every rank to start update `step` (a one-rank trainer needs no message).

        First, if engines of the plan write only inside their update window
        (`ReceiverConfig.update_window`), wait (up to `timeout_s`, default the control plane's)
        until each opened one for this update. If one did not, or the caller refused the
        update (`refuse`), every rank is told not to start (no byte is written) and the
        returned text says why ("" otherwise): each rank then reports the update failed. A
        trainer rank already gone (`transfer.presence`) fails it at once, named.
        """
        with self._gone_lock:
            self._in_flight = step
            gone = dict(self._gone)
        t = self.control.config.timeout_s if timeout_s is None else timeout_s
        refused = self._refusals.pop(step, None)
        if refused is not None:
            error = f"update {step} not started, nothing was written: {refused}"
        else:
            error = self._wait_windows(step, t)
        if self.config.num_trainer_ranks > 1:
            self.control.put(f"go/{step}", Go(step=step, error=error))
        for rank, why in gone.items():
            self._fail_for_gone(self.control, step, rank, why)
        return error

    def _wait_windows(self, step: int, timeout_s: float) -> str:
        """Wait until every windowed engine of the plan opened an update window that is not
        over (`Window`); "" when they did, else why not. One blocking wait for all their keys
        and one read per 64 (re-read with a backoff while a window is over: its engine
        overwrites it when it opens the next)."""
        windowed = sorted(e for e, j in self.joins.items() if j.window)
        if not windowed:
            return ""
        keys = {window_key(e): e for e in windowed}
        over: dict[str, int] = {}

        def current(key: str, w: Window) -> bool:
            engine = keys[key]
            if w.engine != engine:
                return False
            if w.step <= self._committed_into.get(engine, 0):
                over[engine] = w.step
                return False
            over.pop(engine, None)
            return True

        got = self.control.collect(list(keys), Window, timeout_s, accept=current)
        if got.complete:
            return ""
        late = sorted(
            [keys[k] for k in got.missing] + [e for e in over if window_key(e) in got.refused]
        )
        forged = {k: why for k, why in got.refused.items() if keys[k] not in over}
        parts = []
        if late:
            parts.append(
                f"engine(s) {late[:5]} did not open an update window within {timeout_s:.1f} s "
                "(ReceiverConfig.update_window: an engine opens one with begin_update, "
                "wait_for_version or apply_delta)"
            )
        if forged:
            parts.append(
                f"the window(s) {sorted(forged)} are not authentic: {next(iter(forged.values()))}"
            )
        return f"update {step} not started, nothing was written: " + "; ".join(parts)

    def _rank_gone(self, rank: int, why: str) -> None:
        """The presence listener's thread: trainer rank `rank` is gone; fail the update in
        flight now (and, through `go`, every later one)."""
        with self._gone_lock:
            self._gone[rank] = why
            step = self._in_flight
        if step is not None and self._presence_control is not None:
            self._fail_for_gone(self._presence_control, step, rank, why)

    def _rank_present(self, rank: int) -> None:
        """The presence listener's thread: trainer rank `rank` (re)joined."""
        with self._gone_lock:
            self._gone.pop(rank, None)

    def _fail_for_gone(self, control: ControlPlane, step: int, rank: int, why: str) -> None:
        """Write what a gone rank can no longer write for update `step`: its failed reports of
        both phases (unless it made them), the update's abort (every rank's failure watch
        wakes and stops), and its arrival at every mesh-group barrier with a failed release
        (no rank waits there for it). Each only if not there already."""
        report = Done(rank=rank, step=step, ok=False, error=why, nbytes=0, seconds=0.0)
        items: list[tuple[str, object, type]] = [
            (f"{Phase.DONE.value}/{step}/{rank}", report, Done),
            (f"{Phase.COMMITTED.value}/{step}/{rank}", report, Done),
            (f"abort/{step}", Failure(message=why), Failure),
        ]
        groups = self.schedule.ranks[0].num_mesh_groups if self.schedule else 1
        for g in range(1, groups):
            if rank > 0:
                items.append((f"barrier/group/{step}/{g}/{rank}", Go(step=rank), Go))
            release = BarrierRelease(ok=False, error=why, forged=False)
            items.append((f"barrier/group/{step}/{g}/release", release, BarrierRelease))
        for key, message, cls in items:
            try:
                control.put_first(key, message, cls)
            except WeightTransferError as exc:
                log.warning("controller: could not write %r for %s: %s", key, why, exc)

    def decide(
        self, step: int, phase: Phase, timeout_s: float, *, own: Done | None = None
    ) -> Decision:
        """Collect every rank's report for a phase and publish the verdict.

        The reports are read together: one blocking wait for all of them and one read per 64
        ranks; each must be authentic and name its rank and step. A rank that does not report
        within `timeout_s` is named in the verdict. `own` is the report of the trainer rank
        hosting the controller, handed over in memory (it is not published). The DONE verdict
        of a successful update is published only when another trainer rank reads it. Once an
        update is decided (its DONE verdict failed, or its COMMITTED verdict is in) its result
        is published three ways, for the engines: `result/<step>`, `next/<previous decided
        step>` (how an engine waiting for a step the trainers skip hears of the next one) and
        `latest`.
        """
        n = self.config.num_trainer_ranks
        keys = {f"{phase.value}/{step}/{r}": r for r in range(n) if own is None or r != own.rank}
        got = self.control.collect(
            list(keys), Done, timeout_s, accept=lambda k, d: d.rank == keys[k] and d.step == step
        )
        errors = []
        what = "plan" if phase is Phase.BUILT else "update"
        for r in range(n):
            key = f"{phase.value}/{step}/{r}"
            d = own if own is not None and r == own.rank else got.values.get(key)
            if d is None:
                if key in got.refused:
                    errors.append(
                        f"trainer rank {r}'s {phase.value} report for {what} {step} is not "
                        f"authentic: {got.refused[key]}"
                    )
                else:
                    errors.append(
                        f"trainer rank {r} did not report {phase.value} for {what} {step} in time"
                    )
                continue
            if not d.ok:
                who = f"trainer rank {r}: "
                errors.append(d.error if d.error.startswith(who) else who + d.error)
        # Ranks that only stopped because another failed add nothing when the cause is known.
        causes = [e for e in errors if " aborted: " not in e]
        decision = Decision(step=step, ok=not errors, error="; ".join(causes or errors))
        if phase is Phase.BUILT:
            if n > 1:
                self.control.put(f"{phase.verdict_key}/{step}", decision)
            return decision
        verdict: list[tuple[str, object]] = []
        if phase is Phase.COMMITTED or not decision.ok or n > 1 or own is None:
            verdict.append((f"{phase.verdict_key}/{step}", decision))
        if phase is Phase.COMMITTED or not decision.ok:
            # The update is decided (a failed DONE verdict: no version word was written).
            with self._gone_lock:
                if self._in_flight == step:
                    self._in_flight = None
            verdict += self._decided_now(decision, with_result=phase is Phase.DONE)
            if phase is Phase.COMMITTED and decision.ok:
                self._last_committed = step
                for e in self.joins:
                    self._committed_into[e] = step
        self.control.put_many(verdict)  # one request: the verdict and the engines' keys
        if phase is Phase.DONE and n > 1:
            # Ends every rank's watch for another rank's failure (`abort/<step>`), unless a
            # failure is there already (after the verdict: off the commit's path).
            try:
                self.control.put_first(f"abort/{step}", Failure(message=""), Failure)
            except ControlPlaneAuthError as exc:
                log.warning("controller: %s", exc)
                self.control.put(f"abort/{step}", Failure(message=""))
        return decision

    def _decided_now(self, decision: Decision, *, with_result: bool) -> list[tuple[str, object]]:
        """What to publish for the engines about a decided update; forgets the oldest
        updates past the window."""
        prev = self._decided[-1][0] if self._decided else 0
        items: list[tuple[str, object]] = [(f"next/{prev}", decision), ("latest", decision)]
        if with_result:
            items.append((f"result/{decision.step}", decision))
        groups = self.schedule.ranks[0].num_mesh_groups if self.schedule else 1
        if self._dead_plan_keys:
            # Every rank reported this update, so each is past the re-plans before it.
            self._clean(self._dead_plan_keys)
            self._dead_plan_keys = []
        self._decided.append((decision.step, tuple(self.joins), groups))
        while len(self._decided) > _KEEP_STEPS:
            self._forget(*self._decided.popleft())
        return items

    def forget_later(self, step: int, keys: Sequence[str]) -> None:
        """Delete `keys` with update `step`'s own keys, once it is old (see `_forget`)."""
        self._extra.setdefault(step, []).extend(keys)

    def _forget(self, step: int, engines: Sequence[str], groups: int) -> None:
        """Delete the per-update keys of an old step, so the store does not grow per update.

        The deletes run on a background thread and connection (`_Janitor`), off the update's
        critical path.
        """
        n = self.config.num_trainer_ranks
        keys = [f"go/{step}", f"commit/{step}", f"result/{step}", f"abort/{step}", f"next/{step}"]
        for r in range(n):
            keys += [f"done/{step}/{r}", f"committed/{step}/{r}"]
        keys += [f"digest/{step}/{e}" for e in engines]
        for g in range(1, groups):
            keys.append(f"barrier/group/{step}/{g}/release")
            keys += [f"barrier/group/{step}/{g}/{r}" for r in range(1, n)]
        keys += self._extra.pop(step, [])
        for old in [s for s in self._extra if s < step]:
            keys += self._extra.pop(old)
        self._clean(keys)

    def _plan_keys(self, epoch: int) -> list[str]:
        """Every key of plan `epoch`: schedules, stages, build reports and switch verdict."""
        n = self.config.num_trainer_ranks
        keys = [plan_key(epoch, f"schedule/{r}") for r in range(n)]
        keys += [plan_key(epoch, f"plan_error_seen/{r}") for r in range(n)]
        keys += [stage_key(epoch, "started"), stage_key(epoch, "result")]
        if epoch > 0:
            keys += [f"built/{epoch}/{r}" for r in range(n)] + [f"switch/{epoch}"]
        return keys

    def _forget_slots(self) -> None:
        """Delete the manifests of join slots that neither the plan in use nor a pending one
        uses and that are no engine's newest join (an engine's older joins, after it
        rejoined and the plan moved to the new one). Their claims stay: engines find a free
        slot by claiming in order, so a claim is never given back (one small value per join)."""
        keep = set(self._slot_of.values()) | {i for i, _ in self._latest.values()}
        if self._pending is not None:
            keep |= set(self._pending.slot_of.values())
        stale = sorted(self._live_slots - keep)
        self._live_slots -= set(stale)
        if stale:
            self._clean([f"engine_slot/{i}" for i in stale])

    def _clean(self, keys: list[str]) -> None:
        if self._janitor is None:
            self._janitor = _Janitor(self.control)
        self._janitor.delete(keys)

    def verify(
        self, step: int, expected: Mapping[str, Mapping[str, torch.Tensor]], timeout_s: float
    ) -> list[str]:
        """Compare engines' published digests with expected tensors; return mismatching names.

        Args:
            expected: engine name -> tensor name -> expected tensor.
        """
        from weight_transfer.receiver import tensor_digest

        bad = []
        for engine, tensors in sorted(expected.items()):
            got = dict(self.control.get(f"digest/{step}/{engine}", Digests, timeout_s).digests)
            for name, t in sorted(tensors.items()):
                if got.get(name) != tensor_digest(t):
                    bad.append(f"{engine}:{name}")
        return bad

    def close(self, linger_s: float = 5.0) -> None:
        """Stop hosting: the store stops, and every member still connected loses it.

        An engine learns that an update is complete from the controller's result, so first wait,
        at most `linger_s`, until every engine that acknowledges updates (its
        `wait_for_version` returned one before) has seen the last committed update. Engines
        that only read `receiver.version` never acknowledge and are not waited for.
        """
        cp = self.control
        if self._last_committed and self.joins and linger_s > 0:
            deadline = time.monotonic() + linger_s
            waiting = [f"seen/{e}" for e in sorted(self.joins) if cp.exists(f"seen/{e}")]
            while waiting and time.monotonic() < deadline:
                still = []
                for k, raw in zip(waiting, cp.read_many(waiting), strict=True):
                    try:
                        seen = codec.from_msgpack(Seen, cp.unseal(cp.full_key(k), raw))
                    except (ControlPlaneAuthError, ValueError):
                        seen = None
                    if seen is None or seen.step < self._last_committed:
                        still.append(k)
                waiting = still
                if waiting:
                    time.sleep(0.02)
            if waiting:
                log.info(
                    "controller: closing before engine(s) %s saw update %d",
                    [k.removeprefix("seen/") for k in waiting],
                    self._last_committed,
                )
        if self._janitor is not None:
            self._janitor.close()
        self._close_presence()
        cp.close()

    def _close_presence(self) -> None:
        if self._presence is not None:
            self._presence.close()
            self._presence = None
        if self._presence_control is not None:
            self._presence_control.close()
            self._presence_control = None
