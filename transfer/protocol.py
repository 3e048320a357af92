"""Control-plane messages: the only things that travel between members, besides raw bytes.

Keys (under the session prefix):
    hello                          Hello        written by the controller: protocol, run id
    claim/engine/<name>            Claim        an engine name, claimed once per session run
    claim/engine_slot/<i>          Claim        join slot i, claimed by one engine join
    trainer/<rank>                 TrainerJoin  a trainer rank's source manifest
    engine_slot/<i>                EngineJoin   an engine's destination manifest and endpoint
    plan/<e>/started               PlanStage    the controller began plan e (how long it may
                                                wait for joins)
    plan/<e>/result                PlanStage    plan e published, or why it failed
    schedule/<rank>                RankPlan     a trainer rank's part of the schedule
    plan_error_seen/<rank>         Done         trainer rank read a failed plan's result (the
                                                controller's process lingers for these before
                                                it raises)
    epoch/<e>/schedule/<rank>      RankPlan     the same for re-plan e > 0 (`Controller.replan`)
    built/<e>/<rank>               Done         trainer rank built its part of re-plan e
    switch/<e>                     Decision     controller: every rank switches to plan e, or
                                                every rank keeps the plan it runs
    window/<engine>                Window       an engine (`ReceiverConfig.update_window`) closed
                                                its serving gate: writes of updates from `step`
                                                on may land until one of them completes there
    go/<step>                      Go           start update `step` (or, with an error, do not:
                                                an engine did not open its update window)
    barrier/group/<step>/<g>/<r>   Go           trainer rank r > 0 reached mesh group g's barrier
    barrier/group/<step>/<g>/release BarrierRelease  rank 0: every rank arrived (or who did not)
    abort/<step>                   Failure      the first failure of a rank in update `step`
                                                (the other ranks' watches wake at once), or,
                                                with an empty message, the controller's "every
                                                rank reported" that ends the watches
    done/<step>/<rank>             Done         rank finished its writes (ok or error)
    commit/<step>                  Decision     controller: write version words, or abort
    committed/<step>/<rank>        Done         rank wrote its engines' version words
    result/<step>                  Decision     final outcome every member raises on if not ok
    next/<u>                       Decision     the outcome of the update decided after update
                                                u (0: the session's first); engines follow it
    latest                         Decision     the newest decided update's outcome
    digest/<step>/<engine>         Digests      (verification) per-tensor sha256 of an engine
    seen/<engine>                  Seen         the last update an engine saw complete
                                                (`Controller.close` lingers for it)
    presence                       PresenceAddress  where the controller hears trainer ranks'
                                                presence connections (`transfer.presence`)

Every value is encrypted and authenticated under the run's key, bound to its store key and run
id (`transfer.control`); nothing is decided on a plain counter (`auth_failures` only makes a
join fail early) or on a key's existence. The per-update keys of a step are deleted once eight
later updates were decided (whatever the steps' numbers); a plan's keys once every rank
switched away from it; a re-plan's that failed or was not switched to once every rank is past
it (the next decided update or switch). Join slots are claimed in order with an atomic
compare-and-set (a slot a stranger's value holds is skipped); a restarted engine takes a new
slot under its old name, and the old slot's manifest is deleted once no plan uses it (its
claim, a small value, stays: slots are never given back).
"""

from __future__ import annotations

import dataclasses

from weight_transfer.planner.types import DestManifest, RankSchedule, SourceManifest


@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    """Written by the controller when it hosts the store; readers check the token on it."""

    protocol: int
    session: str
    run_id: bytes
    """Fresh random bytes per controller start: the salt of the run's key."""


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """A sealed claim of a name or slot (`ControlPlane.claim`)."""

    member: str
    nonce: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class TrainerJoin:
    """A trainer rank's source manifest."""

    manifest: SourceManifest


@dataclasses.dataclass(frozen=True, slots=True)
class EngineJoin:
    """An engine rank's destination manifest and transport endpoint."""

    manifest: DestManifest
    transport: str
    endpoint: bytes
    window: bool = False
    """Trainers write into this engine only inside an update window it opened
    (`ReceiverConfig.update_window`; `Window`)."""


def window_key(engine: str) -> str:
    """Where `engine` announces its update window (`Window`)."""
    return f"window/{engine}"


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """An engine's update window: its serving gate is closed, and stays closed until an update
    `step` or later completes there, so writes of such an update may land.

    The controller takes it for update u while no update at or after `step` committed into
    this engine (once one did, the engine's wait returned and the gate may be open again).
    """

    engine: str
    step: int


@dataclasses.dataclass(frozen=True, slots=True)
class EnginePeer:
    """What a trainer rank needs to write into one engine."""

    name: str
    endpoint: bytes
    """The engine's transport endpoint (`Transport.connect`)."""
    descriptors: tuple[bytes, ...]
    """Its region descriptors (`RegionDescriptor.to_bytes`), indexed by region index."""
    version_region: int
    """Index of its version-word region among `descriptors`."""

    def __post_init__(self) -> None:
        if not 0 <= self.version_region < len(self.descriptors):
            raise ValueError(
                f"engine {self.name!r}: version region {self.version_region} is not one of its "
                f"{len(self.descriptors)} regions"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlan:
    """A trainer rank's part of the schedule plus the engines it connects to."""

    fingerprint: str
    schedule: RankSchedule
    engines: tuple[EnginePeer, ...]
    """One per engine of `schedule.peers`, in that order."""

    def __post_init__(self) -> None:
        names = tuple(e.name for e in self.engines)
        if names != self.schedule.peers:
            raise ValueError(
                f"trainer rank {self.schedule.rank}: the plan's engines {list(names)} are not "
                f"its schedule's peers {list(self.schedule.peers)}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """A failure report that every member raises."""

    message: str
    problems: tuple[str, ...] = ()
    """For a failed plan: every problem found (each member raises `PlanMismatchError`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Go:
    """Start update `step`, unless `error` says why not (then no rank writes a byte)."""

    step: int
    error: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class PresenceAddress:
    """Where the controller's presence listener listens (on the control plane's host)."""

    port: int


@dataclasses.dataclass(frozen=True, slots=True)
class BarrierRelease:
    """Member 0's verdict on a barrier: every member arrived, or who did not."""

    ok: bool
    error: str
    forged: bool
    """An arrival failed authentication (every member raises `ControlPlaneAuthError`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStage:
    """A stage of planning epoch `epoch` (`plan/<e>/started`, `plan/<e>/result`).

    The controller publishes each with a compare-and-set; a trainer rank that gave up waiting
    publishes its own (ok False, naming itself) the same way, so all ranks, the controller
    included, see the same outcome.
    """

    epoch: int
    ok: bool
    error: str
    wait_s: float
    """For `started`: how long the controller may still wait for members to join."""
    problems: tuple[str, ...] = ()
    """A failed plan's problems (every rank raises `PlanMismatchError` with them)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """An engine saw update `step` complete (`wait_for_version` returned it)."""

    engine: str
    step: int


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """A rank's outcome for one phase of an update."""

    rank: int
    step: int
    ok: bool
    error: str
    nbytes: int
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """The controller's verdict for a phase: proceed, or abort naming who failed."""

    step: int
    ok: bool
    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class Digests:
    """Per-tensor sha256 of an engine's tensors after an update (verification mode)."""

    engine: str
    step: int
    version: int
    digests: tuple[tuple[str, str], ...]
