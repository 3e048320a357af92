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

import enum
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence

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
from weight_transfer.planner.plan import plan
from weight_transfer.planner.types import DestManifest, Schedule, SourceManifest
from weight_transfer.protocol import (
    Decision,
    Digests,
    Done,
    EngineJoin,
    EnginePeer,
    Failure,
    Go,
    RankPlan,
    Seen,
    TrainerJoin,
)

log = logging.getLogger(__name__)

_KEEP_STEPS = 8
"""Per-update keys older than this many steps are deleted from the store (bounded memory)."""
_JOIN_POLL_S = 0.05
_JOIN_SLICE_S = 0.5
"""How often the controller, waiting for engines to join, checks for members refused for their
token (so a token mismatch fails within a second instead of at the timeout)."""


class Phase(str, enum.Enum):
    """The two phases of an update the controller arbitrates, named by their report keys.

    DONE: every rank wrote its bytes (its `done/<step>/<rank>` report); the verdict is
    published as `commit/<step>`. COMMITTED: every rank wrote its engines' version words
    (`committed/<step>/<rank>`); the verdict is `result/<step>`.
    """

    DONE = "done"
    COMMITTED = "committed"

    @property
    def verdict_key(self) -> str:
        """Where the controller publishes this phase's verdict."""
        return "commit" if self is Phase.DONE else "result"


def plan_key(epoch: int, name: str) -> str:
    """Store key of a per-plan message (`schedule/<rank>`, `plan_error`) in plan `epoch`."""
    return name if epoch == 0 else f"epoch/{epoch}/{name}"


class _Janitor:
    """Deletes old store keys on a daemon thread, so an update does not wait for it.

    The control plane is thread-safe for distinct keys, and these keys belong to updates
    `_KEEP_STEPS` old that nobody reads any more. A failed delete is logged and dropped (the
    key only costs store memory).
    """

    _CLOSE_TIMEOUT_S = 5.0

    def __init__(self, control: ControlPlane) -> None:
        self._control = control
        self._jobs: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="wt-controller-janitor", daemon=True)
        self._thread.start()

    def delete(self, keys: list[str]) -> None:
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

    def close(self) -> None:
        """Finish the deletes queued so far (bounded), then stop."""
        self._jobs.put(None)
        self._thread.join(self._CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.info("controller: old store keys still being deleted at close")


class Controller:
    """Plans the transfer and arbitrates every update.

    Not thread-safe. Methods block with the control plane's timeout.
    """

    def __init__(self, config: ControllerConfig, control: ControlPlaneConfig) -> None:
        """Host the control plane.

        Raises:
            TransportTimeoutError: the port cannot be bound.
        """
        self.config = config
        self.control = ControlPlane(control, server=True, member="controller")
        self.schedule: Schedule | None = None
        self.sources: list[SourceManifest] = []
        self.dests: list[DestManifest] = []
        self.joins: dict[str, EngineJoin] = {}
        self.epoch = 0
        """Number of the current plan (0 for the first; `replan` counts up)."""
        self._slot_of: dict[str, int] = {}  # engine -> join slot the current plan uses
        self._latest: dict[str, tuple[int, EngineJoin]] = {}  # engine -> newest join seen
        self._slots_read = 0
        self._last_committed = 0
        """Last update whose version words were all written (what `close` lingers for)."""
        self._janitor: _Janitor | None = None

    def plan(self) -> Schedule:
        """Wait for every trainer rank and engine to join, plan, publish each rank's part.

        Raises:
            PlanMismatchError: the manifests do not fit (also published to every rank).
            TransportTimeoutError: a member did not join in time (names the missing ones).
        """
        cp = self.control
        n, m = self.config.num_trainer_ranks, self.config.num_engines
        try:
            missing_t = [r for r in range(n) if not cp.exists(f"trainer/{r}")]
            try:
                cp.wait([f"trainer/{r}" for r in range(n)])
            except TransportTimeoutError as exc:
                missing_t = [r for r in range(n) if not cp.exists(f"trainer/{r}")]
                raise TransportTimeoutError(
                    f"controller: trainer rank(s) {missing_t} did not join within "
                    f"{cp.config.timeout_s:.0f} s"
                ) from exc
            self._wait_for_engines(m)
            self.sources = [cp.get(f"trainer/{r}", TrainerJoin).manifest for r in range(n)]
            self._read_slots(m)
            del missing_t
            schedule = self._plan_for([j for _, j in self._latest.values()])
        except (PlanMismatchError, WeightTransferError) as exc:
            cp.put("plan_error", Failure(message=str(exc)))
            raise
        self._publish(schedule)
        return schedule

    def _wait_for_engines(self, m: int) -> None:
        """Wait for `m` engine joins; fail at once if a member was refused for its token.

        Polls (one store check per `_JOIN_POLL_S`) rather than slicing a blocking store wait:
        each store wait that times out makes torch log two warnings ("timed out after 500ms"),
        and engines routinely take seconds to start.
        """
        cp = self.control
        keys = [f"engine_slot/{i}" for i in range(m)]
        deadline = time.monotonic() + cp.config.timeout_s
        next_auth_check = time.monotonic()
        while not cp.all_exist(keys):
            now = time.monotonic()
            if now >= next_auth_check:
                next_auth_check = now + _JOIN_SLICE_S
                refused = cp.auth_failures()
                if refused:
                    joined = sum(cp.exists(k) for k in keys)
                    raise ControlPlaneAuthError(
                        f"controller: {refused} member(s) tried to join with another token; "
                        f"{joined} of {m} engines joined (every member needs this run's token)"
                    )
            if now >= deadline:
                joined = sum(cp.exists(k) for k in keys)
                raise TransportTimeoutError(
                    f"controller: {joined} of {m} engines joined within {cp.config.timeout_s:.0f} s"
                )
            time.sleep(_JOIN_POLL_S)

    def _read_slots(self, upto: int) -> None:
        """Read join slots [`_slots_read`, upto); a later join of a name supersedes earlier ones."""
        for i in range(self._slots_read, upto):
            j = self.control.get(f"engine_slot/{i}", EngineJoin)
            self._latest[j.manifest.engine] = (i, j)
        self._slots_read = max(self._slots_read, upto)

    def _plan_for(self, joins: Sequence[EngineJoin]) -> Schedule:
        for j in joins:
            if j.transport != joins[0].transport:
                raise WeightTransferError(
                    f"engine {j.manifest.engine!r} uses transport {j.transport!r}, "
                    f"engine {joins[0].manifest.engine!r} uses {joins[0].transport!r}"
                )
        t0 = time.perf_counter()
        schedule = plan(self.sources, [j.manifest for j in joins], self.config.planner)
        log.info(
            "plan %d: %d tasks for %d ranks -> %d engines in %.3f s",
            self.epoch,
            sum(len(r.tasks) for r in schedule.ranks),
            len(self.sources),
            len(joins),
            time.perf_counter() - t0,
        )
        self.joins = {j.manifest.engine: j for j in joins}
        self.dests = [j.manifest for j in joins]
        self._slot_of = {e: self._latest[e][0] for e in self.joins}
        return schedule

    def replan(
        self, *, engines: Sequence[str] | None = None, rejoined: Sequence[str] = ()
    ) -> Schedule:
        """Plan again for a changed set of engines, as the next epoch. Call between updates.

        Normally called through `WeightSender.replan` (collective over the trainer ranks).

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
        try:
            # Inside the try: every rank must learn that this plan number failed.
            if not names or len(set(names)) != len(names):
                raise ConfigurationError(f"replan needs distinct engine names, got {names}")
            stray = sorted(set(rejoined) - set(names))
            if stray:
                raise ConfigurationError(
                    f"rejoined engine(s) {stray} are not among the engines {names}"
                )
            deadline = time.monotonic() + cp.config.timeout_s
            while True:
                claimed = self._slots_read
                while cp.exists(f"claim/engine_slot/{claimed}"):
                    claimed += 1
                # A slot is claimed an instant before its join is published.
                cp.wait([f"engine_slot/{i}" for i in range(self._slots_read, claimed)])
                self._read_slots(claimed)
                waiting = [
                    e
                    for e in names
                    if e not in self._latest
                    or (e in rejoined and self._latest[e][0] <= self._slot_of.get(e, -1))
                ]
                if not waiting:
                    break
                if time.monotonic() > deadline:
                    raise TransportTimeoutError(
                        f"controller: engine(s) {waiting} did not (re)join within "
                        f"{cp.config.timeout_s:.0f} s for plan {epoch}"
                    )
                time.sleep(_JOIN_POLL_S)
            schedule = self._plan_for([self._latest[e][1] for e in names])
        except (PlanMismatchError, WeightTransferError) as exc:
            cp.put(plan_key(epoch, "plan_error"), Failure(message=str(exc)))
            raise
        self._publish(schedule)
        return schedule

    def _publish(self, schedule: Schedule) -> None:
        cp = self.control
        descriptors = {
            d.engine: tuple(r.descriptor for r in sorted(d.regions, key=lambda r: r.index))
            for d in self.dests
        }
        for rs in schedule.ranks:
            cp.put(
                plan_key(self.epoch, f"schedule/{rs.rank}"),
                RankPlan(
                    fingerprint=schedule.fingerprint,
                    schedule=rs,
                    engines=tuple(
                        EnginePeer(
                            name=e,
                            endpoint=self.joins[e].endpoint,
                            descriptors=descriptors[e],
                            version_region=self.joins[e].manifest.version_region,
                        )
                        for e in rs.peers
                    ),
                ),
            )
        self.schedule = schedule

    # -- per update ------------------------------------------------------------------------

    def go(self, step: int) -> None:
        """Tell every rank to start update `step` (a one-rank trainer needs no message)."""
        if self.config.num_trainer_ranks > 1:
            self.control.put(f"go/{step}", Go(step=step))

    def decide(
        self, step: int, phase: Phase, timeout_s: float, *, own: Done | None = None
    ) -> Decision:
        """Collect every rank's report for a phase and publish the verdict.

        A rank that does not report within `timeout_s` is named in the verdict. `own` is the
        report of the trainer rank hosting the controller, handed over in memory (it is not
        published). The DONE verdict of a successful update is published only when another
        trainer rank reads it; a failed one always is (engines watch for it). The COMMITTED
        verdict is always published: engines confirm an update from it.
        """
        n = self.config.num_trainer_ranks
        deadline = time.monotonic() + timeout_s
        errors = []
        for r in range(n):
            if own is not None and r == own.rank:
                d = own
            else:
                key = f"{phase.value}/{step}/{r}"
                try:
                    d = self.control.get(key, Done, max(0.001, deadline - time.monotonic()))
                except TransportTimeoutError:
                    errors.append(
                        f"trainer rank {r} did not report {phase.value} for update {step} in time"
                    )
                    continue
            if not d.ok:
                who = f"trainer rank {r}: "
                errors.append(d.error if d.error.startswith(who) else who + d.error)
        # Ranks that only stopped because another failed add nothing when the cause is known.
        causes = [e for e in errors if " aborted: " not in e]
        decision = Decision(step=step, ok=not errors, error="; ".join(causes or errors))
        if phase is Phase.COMMITTED or not decision.ok or n > 1 or own is None:
            self.control.put(f"{phase.verdict_key}/{step}", decision)
        if phase is Phase.COMMITTED and decision.ok:
            self._last_committed = step
        if phase is Phase.COMMITTED:
            self._forget(step - _KEEP_STEPS)
        return decision

    def _forget(self, step: int) -> None:
        """Delete the per-update keys of an old step, so the store does not grow per update.

        The deletes run on a background thread (`_Janitor`), off the update's critical path:
        about ten store round trips that used to be part of every `update()`.
        """
        if step < 1:
            return
        keys = [f"go/{step}", f"commit/{step}", f"result/{step}", f"abort/{step}"]
        for r in range(self.config.num_trainer_ranks):
            keys += [f"done/{step}/{r}", f"committed/{step}/{r}"]
        keys += [f"digest/{step}/{e}" for e in self.joins]
        groups = self.schedule.ranks[0].num_mesh_groups if self.schedule else 1
        keys += [
            f"barrier/group/{step}/{g}/{r}"
            for g in range(1, groups)
            for r in range(self.config.num_trainer_ranks)
        ]
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
        """Stop hosting (the store lives until the process ends).

        An engine learns that an update is complete from the controller's result, so first wait,
        at most `linger_s`, until every engine that acknowledges updates (its
        `wait_for_version` returned one before) has seen the last committed update. Engines
        that only read `receiver.version` never acknowledge and are not waited for.
        """
        if self._last_committed and self.joins and linger_s > 0:
            deadline = time.monotonic() + linger_s
            waiting = [e for e in sorted(self.joins) if self._has_seen(e, 1)]
            while waiting and time.monotonic() < deadline:
                waiting = [e for e in waiting if not self._has_seen(e, self._last_committed)]
                if waiting:
                    time.sleep(0.01)
            if waiting:
                log.info(
                    "controller: closing before engine(s) %s saw update %d",
                    waiting,
                    self._last_committed,
                )
        if self._janitor is not None:
            self._janitor.close()
        self.control.close()

    def _has_seen(self, engine: str, step: int) -> bool:
        key = f"seen/{engine}"
        try:
            return self.control.exists(key) and self.control.get(key, Seen, 1.0).step >= step
        except WeightTransferError:
            return False
