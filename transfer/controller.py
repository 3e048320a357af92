"""The controller: hosts the control plane, plans once, runs each update's commit protocol.

It lives in trainer rank 0's process (or any process the deployment chooses). It never touches
weights: it gathers manifests, runs the planner, hands every trainer rank its part of the
schedule, and per update turns the ranks' reports into one decision that every rank raises on,
so an engine's version word advances only after every write into it completed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from backends.base import (
    PlanMismatchError,
    TransportTimeoutError,
    WeightTransferError,
)
from planner.plan import plan
from planner.types import DestManifest, Schedule, SourceManifest
from transfer.config import ControlPlaneConfig, ControllerConfig
from transfer.control import ControlPlane
from transfer.protocol import Decision, Digests, Done, EngineJoin, Failure, Go, RankPlan, TrainerJoin

log = logging.getLogger(__name__)


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
            try:
                cp.wait([f"engine_slot/{i}" for i in range(m)])
            except TransportTimeoutError as exc:
                joined = sum(cp.exists(f"engine_slot/{i}") for i in range(m))
                raise TransportTimeoutError(
                    f"controller: {joined} of {m} engines joined within {cp.config.timeout_s:.0f} s"
                ) from exc
            self.sources = [cp.get(f"trainer/{r}", TrainerJoin).manifest for r in range(n)]
            joins = [cp.get(f"engine_slot/{i}", EngineJoin) for i in range(m)]
            self.joins = {j.manifest.engine: j for j in joins}
            self.dests = [j.manifest for j in joins]
            for j in joins:
                if j.transport != joins[0].transport:
                    raise WeightTransferError(
                        f"engine {j.manifest.engine!r} uses transport {j.transport!r}, "
                        f"engine {joins[0].manifest.engine!r} uses {joins[0].transport!r}"
                    )
            del missing_t
            t0 = time.perf_counter()
            schedule = plan(self.sources, self.dests, self.config.planner)
            log.info(
                "planned %d tasks for %d ranks -> %d engines in %.3f s",
                sum(len(r.tasks) for r in schedule.ranks), n, m, time.perf_counter() - t0,
            )
        except (PlanMismatchError, WeightTransferError) as exc:
            cp.put("plan_error", Failure(message=str(exc)))
            raise
        descriptors = {
            d.engine: tuple(r.descriptor for r in sorted(d.regions, key=lambda r: r.index))
            for d in self.dests
        }
        for rs in schedule.ranks:
            cp.put(
                f"schedule/{rs.rank}",
                RankPlan(
                    fingerprint=schedule.fingerprint,
                    schedule=rs,
                    endpoints=tuple((e, self.joins[e].endpoint) for e in rs.peers),
                    descriptors=tuple((e, descriptors[e]) for e in rs.peers),
                    version_regions=tuple(
                        (e, self.joins[e].manifest.version_region) for e in rs.peers
                    ),
                ),
            )
        self.schedule = schedule
        return schedule

    # -- per update ------------------------------------------------------------------------

    def go(self, step: int) -> None:
        """Tell every rank to start update `step`."""
        self.control.put(f"go/{step}", Go(step=step))

    def decide(self, step: int, phase: str, timeout_s: float) -> Decision:
        """Collect every rank's report for a phase ("done" or "committed") and publish the verdict.

        A rank that does not report within `timeout_s` is named in the verdict.
        """
        n = self.config.num_trainer_ranks
        deadline = time.monotonic() + timeout_s
        errors = []
        for r in range(n):
            key = f"{phase}/{step}/{r}"
            try:
                d = self.control.get(key, Done, max(0.001, deadline - time.monotonic()))
            except TransportTimeoutError:
                errors.append(f"trainer rank {r} did not report {phase} for update {step} in time")
                continue
            if not d.ok:
                errors.append(f"trainer rank {r}: {d.error}")
        decision = Decision(step=step, ok=not errors, error="; ".join(errors))
        out_key = "commit" if phase == "done" else "result"
        self.control.put(f"{out_key}/{step}", decision)
        return decision

    def verify(
        self, step: int, expected: Mapping[str, Mapping[str, torch.Tensor]], timeout_s: float
    ) -> list[str]:
        """Compare engines' published digests with expected tensors; return mismatching names.

        Args:
            expected: engine name -> tensor name -> expected tensor.
        """
        from transfer.receiver import tensor_digest

        bad = []
        for engine, tensors in sorted(expected.items()):
            got = dict(self.control.get(f"digest/{step}/{engine}", Digests, timeout_s).digests)
            for name, t in sorted(tensors.items()):
                if got.get(name) != tensor_digest(t):
                    bad.append(f"{engine}:{name}")
        return bad

    def close(self) -> None:
        """Stop hosting (the store lives until the process ends)."""
        self.control.close()
