"""Trainer side: publish what this rank holds, receive its schedule, replay it every update."""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weight_transfer.backends.base import (
    PlanMismatchError,
    RegionDescriptor,
    RegionRole,
    Transport,
    TransportConfig,
    TransportTimeoutError,
    UpdateAbortedError,
    WeightTransferError,
    create_transport,
)
from weight_transfer.config import SenderConfig, TransferConfig
from weight_transfer.control import ControlPlane
from weight_transfer.controller import Controller, Phase, plan_key, stage_key
from weight_transfer.delta.session import DeltaSession, DeltaStats, DeltaTransport
from weight_transfer.errors import ConfigurationError, UpdateFailedError, UpdateInProgressError
from weight_transfer.manifest import local_part, named_tensors, source_manifest, storage_view
from weight_transfer.pipeline import (
    Executor,
    SourceBinding,
    UpdatePhases,
    UpdateStats,
    trace_events,
)
from weight_transfer.planner.types import SliceWrite
from weight_transfer.presence import Presence
from weight_transfer.protocol import (
    Decision,
    Done,
    Failure,
    Go,
    PlanStage,
    RankPlan,
    TrainerJoin,
)
from weight_transfer.spans import SpanLog

log = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def full_tensor(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor on every rank of its mesh (a collective for DTensors).

    A CPU-offloaded shard of a GPU mesh is first copied to `device` (the host-to-device stage),
    since the mesh's collectives run on the GPU.
    """
    if DTensor is not None and isinstance(t, DTensor):
        local = t.to_local()
        if (
            device is not None
            and local.device != device
            and t.device_mesh.device_type != local.device.type
        ):
            moved = DTensor.from_local(
                local.to(device, non_blocking=True),
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
            return moved.full_tensor()
        return t.full_tensor()
    local = local_part(t)
    return local if device is None else local.to(device, non_blocking=True)


@dataclasses.dataclass(frozen=True, slots=True)
class _Built:
    """One plan built on one transport: what `WeightSender.replan` switches to or discards."""

    executor: Executor
    source_regions: list[Any]
    """Zero-copy registrations of the trainer's shards on that transport."""
    delta: DeltaSession | None
    """Delta mode's state of that plan (None when off)."""


class _FailureWatch:
    """Hears another trainer rank's failure of the update in flight, for `Executor.run`.

    One thread and one connection of the rank's own: it blocks in the store on
    `abort/<step>`, which the first failing rank publishes, or the controller (an empty
    message) once every rank reported the update. The executor's frequent checks read a
    dictionary: per update this is one wait and one read, whatever the update's length.
    """

    _CLOSE_TIMEOUT_S = 2.0

    def __init__(self, control: ControlPlane, timeout_s: float) -> None:
        self._main = control
        self._control = control.clone(f"{control.member} (failure watch)")
        self._timeout_s = timeout_s
        self._steps: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._failures: dict[int, str] = {}
        self._waiting: int | None = None
        """The update whose `abort/<step>` the thread blocks on now (None: idle)."""
        self._thread = threading.Thread(target=self._run, name="wt-failure-watch", daemon=True)
        self._thread.start()

    def watch(self, step: int) -> Callable[[], str | None]:
        """Start watching update `step`; the returned check gives the failure, once heard."""
        self._steps.put(step)
        failures = self._failures
        return lambda: failures.get(step)

    def _run(self) -> None:
        try:
            while True:
                step = self._steps.get()
                if step is None:
                    return
                for old in [s for s in self._failures if s < step - 16]:
                    del self._failures[old]
                self._waiting = step
                try:
                    report = self._control.get(f"abort/{step}", Failure, self._timeout_s)
                except WeightTransferError as exc:  # the update itself reports what went wrong
                    log.debug("%s: %s", self._control.member, exc)
                    continue
                finally:
                    self._waiting = None
                if report.message:
                    self._failures[step] = report.message
        finally:
            # The thread owns its connection: whenever it ends, the connection goes with it.
            self._control.close()

    def close(self) -> None:
        """Stop the thread and close its connection.

        A thread still blocked on an update that no verdict ended (its controller slow or
        gone) is woken by an empty `abort/<step>` ("nothing to report", as the controller
        writes it), unless a failure report is there already.
        """
        self._steps.put(None)
        deadline = time.monotonic() + self._CLOSE_TIMEOUT_S
        woken: set[int] = set()
        self._thread.join(0.05)
        while self._thread.is_alive() and time.monotonic() < deadline:
            step = self._waiting
            if step is not None and step not in woken:
                woken.add(step)
                try:
                    self._main.put_first(f"abort/{step}", Failure(message=""), Failure)
                except WeightTransferError as exc:  # a lost controller ends the wait as well
                    log.debug("%s: %s", self._control.member, exc)
            self._thread.join(0.05)
        if self._thread.is_alive():
            log.warning(
                "%s: the failure watch did not stop within %.1f s; it ends with its wait",
                self._control.member,
                self._CLOSE_TIMEOUT_S,
            )


@dataclasses.dataclass(frozen=True, slots=True)
class _Outcome:
    """How one step of an update went on this rank."""

    stats: UpdateStats | None = None
    error: str = ""
    """One line naming this rank and what failed ("" if nothing did)."""
    cause: BaseException | None = None


def _process_group_rank() -> tuple[int, int]:
    """(rank, world size) in the default torch.distributed process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class WeightSender:
    """One trainer rank's sender. Every trainer rank makes one; `update` is collective.

    Construction publishes the source manifest, (on rank 0, which hosts the `Controller`)
    plans, fetches this rank's schedule, registers staging memory and the local shards that are
    sent without copies, and connects to the engines it writes to.
    """

    def __init__(
        self,
        params: nn.Module | Mapping[str, torch.Tensor],
        config: TransferConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        controller: Controller | None = None,
        device: torch.device | str | None = None,
        transport: TransportConfig | None = None,
    ) -> None:
        """Join, plan (rank 0), and connect.

        Args:
            params: the trainer's parameters (FSDP2 module with DTensor params, or a mapping);
                a module's persistent buffers are sources too (the float32 router bias of
                DeepSeek-V3 / GLM-4.5-MoE is one in transformers).
            config: the transfer's configuration (control plane, transport, planner with the
                memory budget, sender settings; `num_engines` on rank 0).
            rank, world_size: this rank in the trainer world (DTensor meshes use these ranks);
                default: the default torch.distributed process group's, or 0 and 1 without one.
            controller: a `Controller` made by hand, passed on rank 0 only. Default: rank 0
                hosts one itself (from `config.controller_config`), and closes it in `close`.
            device: where this rank computes ("cuda:0" or "cpu"); default: the params' device.
            transport: this process's `TransportConfig`, for settings the config file does
                not carry per process (a listen address of its own); default:
                `config.transport_config()` on this rank's device.

        Raises:
            ConfigurationError: a bad rank, or `config.num_engines` unset on rank 0.
            PlanMismatchError: the plan failed (the same message on every rank).
            TransportTimeoutError: a peer or the control plane did not answer in time.
        """
        if rank is None or world_size is None:
            group_rank, group_world = _process_group_rank()
            rank = group_rank if rank is None else rank
            world_size = group_world if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ConfigurationError(f"rank {rank} is outside world_size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.transfer_config = config
        """The configuration this sender was built with."""
        self.config: SenderConfig = config.sender
        """This sender's own settings (`config.sender`)."""
        self._params = named_tensors(params, persistent_buffers=True)
        if device is None:
            first = next(iter(self._params.values()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._owns_controller = controller is None and rank == 0
        if self._owns_controller:
            controller = Controller(config.controller_config(world_size), config.control)
        self.controller = controller
        try:
            self._join(config, controller, transport)
        except BaseException:
            presence: Presence | None = getattr(self, "_presence", None)
            if presence is not None:
                presence.close()
            if self._owns_controller and controller is not None:
                controller.close(linger_s=0)
            raise

    def _join(
        self,
        config: TransferConfig,
        controller: Controller | None,
        transport: TransportConfig | None,
    ) -> None:
        rank, world_size = self.rank, self.world_size
        self._control = (
            controller.control
            if controller
            else ControlPlane(config.control, server=False, member=f"trainer rank {rank}")
        )
        self._presence: Presence | None = None
        if controller is None:
            # The controller hears at once if this process is gone (`transfer.presence`).
            self._presence = Presence(self._control, rank, config.control.timeout_s)
        self._last_step = 0
        self._committed_step = 0  # last update whose version words were all written
        self._records: list[tuple[int, float, Any]] = []
        """(step, start in seconds since this sender was made, task records) of recent updates."""
        self._t_created = time.perf_counter()
        self.spans: SpanLog | None = None
        """Where `update` records its phases on the host's shared clock (`weight_transfer.spans`);
        None (the default) records nothing. The vLLM plug-in's updater sets one."""
        manifest = source_manifest(
            self._params, rank=rank, world_size=world_size, compute_device=self.device.type
        )
        self._boxes = {t.name: t.local_box for t in manifest.tensors}
        self._control.put(f"trainer/{rank}", TrainerJoin(manifest=manifest))
        if controller is not None:
            try:
                controller.plan()
            except WeightTransferError:
                controller.linger_for_plan_error(0, rank)
                raise
        self.epoch = 0
        """Number of the plan this rank runs (counts up with `replan`)."""
        rp = self._fetch_plan(0)
        self.schedule = rp.schedule
        self.fingerprint = rp.fingerprint
        if transport is None:
            index = self.device.index if self.device.type == "cuda" else None
            if self.device.type == "cuda" and index is None:
                index = torch.cuda.current_device()
            transport = config.transport_config(device_index=index)
        self._transport_config: TransportConfig = transport
        """This rank's transport settings (a re-plan builds its new transport from them)."""
        self._transport: Transport = create_transport(transport)
        self._source_regions: list[Any] = []
        self._watch: _FailureWatch | None = None
        self._barriers: ControlPlane | None = None
        """The connection mesh-group barriers block on (the prepare thread's): a failure report
        on the rank's own connection must not wait behind a barrier (a connection serves one
        request at a time)."""
        self._delta: DeltaSession | None = None
        self._patch_bytes = 0
        self.delta_stats: DeltaStats | None = None
        """What delta mode did in the last update (mode, why, bytes), or None when off; the
        same as that update's `UpdateStats.delta`."""
        self._outlived: list[Executor] = []
        """Executors of earlier plans whose prepare thread still runs."""
        try:
            self._adopt(self._build(rp, self._transport))
            if world_size > 1:
                self._watch = _FailureWatch(
                    self._control, 2 * self.config.update_timeout_s + self._control.config.timeout_s
                )
                self._barriers = self._control.clone(f"trainer rank {rank} (barriers)")
        except BaseException:
            if self._watch is not None:
                self._watch.close()
            self._transport.close()
            raise

    def _fetch_plan(self, epoch: int) -> RankPlan:
        """This rank's part of plan `epoch`, once the controller published it.

        Waits for the controller's `started` stage (it begins planning), then for its `result`
        as long as the controller said it may wait for members to join, plus the planning. A
        rank that gives up publishes its own outcome of the stage with a compare-and-set, so
        the controller and every rank see the same one.

        Raises:
            PlanMismatchError / WeightTransferError: the plan failed (every rank alike).
            TransportTimeoutError: the controller did not answer in time.
        """
        t = self._control.config.timeout_s
        started = self._stage(epoch, "started", t, "start")
        if not started.ok:
            raise WeightTransferError(started.error)
        result = self._stage(epoch, "result", started.wait_s + t, "finish")
        if not result.ok:
            # The store lives in the controller's process, which lingers for this before its
            # caller (who may exit on the error) goes on.
            self._control.put(
                plan_key(epoch, f"plan_error_seen/{self.rank}"),
                Done(rank=self.rank, step=epoch, ok=False, error="", nbytes=0, seconds=0.0),
            )
            if result.problems:
                raise PlanMismatchError(result.problems)
            raise WeightTransferError(result.error)
        return self._control.get(plan_key(epoch, f"schedule/{self.rank}"), RankPlan, t)

    def _stage(self, epoch: int, stage: str, timeout_s: float, verb: str) -> PlanStage:
        key = stage_key(epoch, stage)
        try:
            return self._control.get(key, PlanStage, timeout_s)
        except TransportTimeoutError:
            mine = PlanStage(
                epoch=epoch,
                ok=False,
                error=(
                    f"trainer rank {self.rank} gave up waiting for plan {epoch} to {verb} "
                    f"after {timeout_s:.0f} s"
                ),
                wait_s=0.0,
            )
            first = self._control.put_first(key, mine, PlanStage)
            return first if first is not None else mine

    def replan(self, *, engines: Sequence[str] | None = None, rejoined: Sequence[str] = ()) -> None:
        """Switch to a new plan after engines restarted, joined or left. Collective.

        Every trainer rank calls it between updates with the same arguments; the rank hosting
        the `Controller` waits for the named engines to (re)join and plans (`Controller.replan`),
        the others wait for their part. Then every rank builds the new plan beside the one it
        runs (a transport of its own: connections, staging memory and registrations), reports
        whether it could, and the controller decides: if every rank built it, all switch to it
        and release the old one; otherwise all release the new one and keep running the old.
        The next `update` uses whichever plan was kept; its step must still be larger than the
        last one. While both exist a rank holds two staging arenas.

        Args:
            engines: engine names of the new plan (default: the current ones).
            rejoined: engines that restarted and joined again with `rejoin=True`.

        Raises:
            TransportTimeoutError: an engine did not (re)join in time (every rank raises).
            PlanMismatchError / WeightTransferError: the new plan failed, or a rank could not
                build it (every rank raises, naming it); the sender keeps its old plan and can
                retry.
        """
        epoch = self.epoch + 1
        self.epoch = epoch  # a failed plan uses up its number too, on every rank alike
        cp = self._control
        if self.controller is not None:
            try:
                self.controller.replan(engines=engines, rejoined=rejoined)
            except WeightTransferError:
                self.controller.linger_for_plan_error(epoch, self.rank)
                raise
        rp = self._fetch_plan(epoch)
        transport = create_transport(self._transport_config)
        built: _Built | None = None
        error = ""
        cause: BaseException | None = None
        try:
            built = self._build(rp, transport)
        except Exception as exc:  # reported, so every rank keeps the old plan
            cause = exc
            error = self._describe(exc)
            log.error("trainer rank %d: building plan %d failed: %s", self.rank, epoch, error)
        report = Done(rank=self.rank, step=epoch, ok=not error, error=error, nbytes=0, seconds=0.0)
        t = cp.config.timeout_s
        try:
            if self.controller is not None:
                decision = self.controller.switch(epoch, report, t)
            else:
                cp.put(f"built/{epoch}/{self.rank}", report)
                decision = cp.get(f"switch/{epoch}", Decision, 2 * t)
        except BaseException:
            self._discard(built, transport)
            raise
        if not decision.ok:
            self._discard(built, transport)
            raise WeightTransferError(
                f"plan {epoch} not adopted (every rank keeps plan {self._plan_epoch}): "
                f"{decision.error}"
            ) from cause
        assert built is not None
        self._release_plan()
        self._transport.close()
        self._transport = transport
        self._adopt(built)
        self._plan_epoch = epoch
        self.schedule = rp.schedule
        self.fingerprint = rp.fingerprint
        log.info(
            "trainer rank %d: now on plan %d (%d tasks)", self.rank, epoch, len(rp.schedule.tasks)
        )

    _plan_epoch = 0
    """The plan this rank runs (`epoch` counts plans made, failed ones included)."""

    def _adopt(self, built: _Built) -> None:
        """Run `built` from the next update on."""
        self._executor = built.executor
        self._source_regions = built.source_regions
        self._delta = built.delta

    @staticmethod
    def _discard(built: _Built | None, transport: Transport) -> None:
        """Release a plan built beside the current one that is not switched to."""
        if built is not None:
            built.executor.close()
            if built.delta is not None:
                built.delta.close()
        transport.close()

    def _release_plan(self) -> None:
        """Undo `_build`: staging, zero-copy registrations and connections of the current plan."""
        if self._executor.busy() is not None:
            # Its prepare thread still runs (it outlived a failed update): the new plan's
            # updates are refused until it ends, as the old plan's were.
            self._outlived.append(self._executor)
        self._executor.close()
        if self._delta is not None:
            self._delta.close()
            self._delta = None
        for region in self._source_regions:
            self._transport.deregister(region)
        self._source_regions = []
        for peer in list(self._transport.peers):
            self._transport.disconnect(peer)

    def _build(self, rp: RankPlan, transport: Transport) -> _Built:
        """This rank's executor of plan `rp` on `transport` (which it connects and registers
        into), and the zero-copy source regions it registered."""
        zero_copy = {
            w.source
            for t in rp.schedule.tasks
            for w in t.writes
            if isinstance(w, SliceWrite) and w.zero_copy
        }
        regions: dict[tuple[str, int], Any] = {}
        source_regions: list[Any] = []
        bindings: dict[str, SourceBinding] = {}
        for name, p in self._params.items():
            local = local_part(p)
            region = None
            if name in zero_copy:
                s = local.untyped_storage()
                key = (str(local.device), s.data_ptr())
                if key not in regions:
                    regions[key] = transport.register(
                        storage_view(s, local.device), role=RegionRole.SOURCE
                    )
                    source_regions.append(regions[key])
                region = regions[key]
            bindings[name] = SourceBinding(
                param=p,
                local_box=self._boxes.get(name),
                region=region,
                storage_ptr=local.untyped_storage().data_ptr(),
            )
        for engine in rp.engines:
            transport.connect(engine.name, engine.endpoint)
        descriptors = {
            e.name: [RegionDescriptor.from_bytes(b) for b in e.descriptors] for e in rp.engines
        }
        plain = transport
        delta = None
        if self.config.delta.enabled:
            # A new plan starts from a full update: the snapshot is made anew.
            delta = DeltaSession(
                rank=self.rank,
                world_size=self.world_size,
                config=self.config.delta,
                schedule=rp.schedule,
                transport=plain,
                descriptors=descriptors,
                version_regions={e.name: e.version_region for e in rp.engines},
                control=self._control,
                device=self.device,
                writers=None
                if self.controller is None or self.controller.newest_schedule is None
                else {
                    e: [r.rank for r in self.controller.newest_schedule.ranks if e in r.peers]
                    for e in self.controller.newest_schedule.engines
                },
            )
            # The pipeline is unchanged; its writes pass through the delta layer.
            transport = typing.cast(Transport, DeltaTransport(plain, delta))
        executor = Executor(
            rank=self.rank,
            schedule=rp.schedule,
            transport=transport,
            sources=bindings,
            descriptors=descriptors,
            version_regions={e.name: e.version_region for e in rp.engines},
            device=self.device,
            # The budget the plan was made for: planner and executor cannot disagree.
            memory_budget_bytes=self.schedule.memory_budget_bytes,
            gather=lambda t: full_tensor(t, self.device),
            barrier=lambda step, g: (self._barriers or self._control).barrier(
                f"group/{step}/{g}", self.world_size, self.rank
            ),
            table_quantize=self.config.table_quantize,
            # Kernels writing straight into mapped engine memory would bypass the delta layer.
            mapped_writes=not self.config.delta.enabled,
        )
        return _Built(executor=executor, source_regions=source_regions, delta=delta)

    def update(self, step: int) -> UpdateStats:
        """Send the current weights as update `step`. Collective: every trainer rank calls it.

        Blocks until every engine's version word reads `step`, or raises on every rank with
        the failing rank and peer named. Whole updates only: if writing the version words
        fails anywhere, every rank sets the words it wrote back to the last complete update
        before raising, so the ranks of a replica (and all engines) advance together or not
        at all; `WeightReceiver.wait_for_version` never reports an update that was rolled back.

        A step is used up when the call starts, whatever its outcome: a retry (after a
        timeout too) takes a later step. If this rank cannot read a verdict (a timeout or a
        lost controller while it waits for one), it sets the version words it wrote back to
        the last complete update before raising, and in delta mode its next update is full.

        Raises:
            ValueError: `step` is not larger than the previous one (tried before, failed or
                not).
            UpdateInProgressError: (an `UpdateFailedError`) refused on this rank: an earlier
                update's prepare thread outlived its deadline and still runs (the other ranks
                raise `UpdateFailedError` naming this rank).
            UpdateFailedError: this or another rank failed (message names them); no engine
                advanced, and a later `update` may retry.
            TransportTimeoutError: a wait for the controller ran past `config.update_timeout_s`.
        """
        if step <= self._last_step:
            raise ValueError(
                f"update step {step} must be larger than the previous ({self._last_step})"
            )
        # Consumed now, whatever happens next: a retry after any failure (a timeout waiting for
        # the controller included) takes a later step, never this one's keys (`go/<step>`,
        # `commit/<step>`, a verdict made from this attempt's reports).
        self._last_step = step
        timeout = self.config.update_timeout_s
        t_go = time.perf_counter()
        try:
            refused = self._go(step, timeout)
        except BaseException:
            if self._delta is not None:
                self._delta.failed()
            raise
        t0 = time.perf_counter()
        if refused:
            # Not started (an engine did not open its update window): nothing was written.
            # The controller's rank reports why; the others as stopped by it.
            cause = WeightTransferError(
                refused if self.controller is not None else f"update {step} aborted: {refused}"
            )
            ran = _Outcome(error=self._describe(cause), cause=cause)
        else:
            ran = self._run(step, timeout)
        t_exec = time.perf_counter()
        done = Done(
            rank=self.rank,
            step=step,
            ok=not ran.error,
            error=ran.error,
            nbytes=ran.stats.nbytes if ran.stats else 0,
            seconds=time.perf_counter() - t0,
        )
        try:
            decision = self._decide(step, Phase.DONE, done, timeout)
        except BaseException:
            # No verdict: this rank's bytes may be in the engines, whether the others
            # committed or not is unknown here (it wrote no version word).
            if self._delta is not None:
                self._delta.outcome_unknown()
            raise
        if not decision.ok:
            if self._delta is not None:
                self._delta.failed()
            message = f"update {step} failed, no engine advanced: {decision.error}"
            if isinstance(ran.cause, UpdateInProgressError):  # this rank refused it
                raise UpdateInProgressError(message, step=step) from ran.cause
            raise UpdateFailedError(message, step=step) from ran.cause
        # A commit verdict needs every rank's success, this one's too: `ran` holds no error.
        t_done = time.perf_counter()
        written = self._commit_versions(step, timeout)
        t_versions = time.perf_counter()
        committed = Done(
            rank=self.rank,
            step=step,
            ok=not written.error,
            error=written.error,
            nbytes=0,
            seconds=0.0,
        )
        try:
            result = self._decide(step, Phase.COMMITTED, committed, timeout)
        except BaseException:
            # This rank cannot tell whether update `step` committed: no word it wrote may
            # claim so (an engine then waits for a later update instead of trusting it).
            if self._delta is not None:
                self._delta.outcome_unknown()
            self._roll_back(step, timeout)
            raise
        if not result.ok:
            if self._delta is not None:
                self._delta.failed()
            self._roll_back(step, timeout)
            raise UpdateFailedError(
                f"update {step}: version words not all written: {result.error}", step=step
            ) from written.cause
        self._committed_step = step
        assert ran.stats is not None
        delta_stats = None
        if self._delta is not None:
            delta_stats = self.delta_stats = self._delta.stats(self._patch_bytes)
            self._delta.committed(step, self._patch_bytes, time.perf_counter() - t_go)
        t_end = time.perf_counter()
        stats = dataclasses.replace(
            ran.stats,
            delta=delta_stats,
            phases=UpdatePhases(
                go_s=t0 - t_go,
                done_s=t_done - t_exec,
                versions_s=t_versions - t_done,
                result_s=t_end - t_versions,
            ),
        )
        self._record(step, t0, stats)
        if self.spans is not None:
            # perf_counter is CLOCK_MONOTONIC on Linux, the spans' clock (`spans.now_ns`).
            for name, a, b in (
                ("go", t_go, t0),
                ("writes (executor)", t0, t_exec),
                ("done verdict", t_exec, t_done),
                ("version words", t_done, t_versions),
                ("commit verdict", t_versions, t_end),
            ):
                self.spans.add(name, round(a * 1e9), round(b * 1e9), step)
        return stats

    # -- the steps of one update -----------------------------------------------------------

    def _go(self, step: int, timeout_s: float) -> str:
        """Start update `step`: the rank hosting the controller says go, the others wait.
        Returns "" to go on, else why the update must not start (`Controller.go`)."""
        if self.controller is not None:
            return self.controller.go(step, timeout_s)
        # The controller may spend `timeout_s` on the engines' update windows before it
        # posts go (with why not, if they did not open): wait for that, plus its own answer.
        wait_s = timeout_s + self._control.config.timeout_s
        return self._control.get(f"go/{step}", Go, wait_s).error

    def _run(self, step: int, timeout_s: float) -> _Outcome:
        """This rank's writes of the update (the executor); any failure is caught, logged and
        returned, since every rank must hear of it before anyone raises."""
        cp = self._control
        self._patch_bytes = 0
        self._outlived = [ex for ex in self._outlived if ex.busy() is not None]
        try:
            if self._outlived:
                refused = UpdateInProgressError(
                    f"trainer rank {self.rank}: update {step} refused: "
                    f"{self._outlived[0].busy()} (before a re-plan) past its deadline; until "
                    "it ends no update can start on this rank",
                    step=step,
                )
                cp.put(f"abort/{step}", Failure(message=self._describe(refused)))
                raise refused
            if self._delta is not None:
                # Mode of this update; waits until the engines applied the last delta.
                self._delta.begin(step, time.monotonic() + timeout_s)
            stats = self._executor.run(
                step,
                timeout_s,
                # Only another trainer rank can abort an update midway.
                cancelled=self._peer_failure(step) if self.world_size > 1 else None,
                on_failure=lambda exc: cp.put(
                    f"abort/{step}", Failure(message=self._describe(exc))
                ),
            )
            if self._delta is not None:
                self._patch_bytes = self._delta.post_patches(step, time.monotonic() + timeout_s)
        except Exception as exc:  # any stage, any exception: every rank must hear of it
            if isinstance(exc, UpdateAbortedError):
                log.info("trainer rank %d: %s", self.rank, exc)
            elif isinstance(exc, WeightTransferError):
                log.error("trainer rank %d: update %d failed: %s", self.rank, step, exc)
            else:
                log.exception("trainer rank %d: update %d failed", self.rank, step)
            return _Outcome(error=self._describe(exc), cause=exc)
        return _Outcome(stats=stats)

    def _decide(self, step: int, phase: Phase, own: Done, timeout_s: float) -> Decision:
        """Report this rank's outcome of a phase and get the verdict every rank acts on.

        The rank hosting the controller hands its report over in memory: with one trainer rank
        an update's control plane is then a single store write (the result).
        """
        if self.controller is not None:
            return self.controller.decide(step, phase, timeout_s, own=own)
        self._control.put(f"{phase.value}/{step}/{self.rank}", own)
        return self._control.get(f"{phase.verdict_key}/{step}", Decision, timeout_s)

    def _commit_versions(self, step: int, timeout_s: float) -> _Outcome:
        """Write `step` into the version words this rank commits; a failure is returned (it is
        reported like any other, then raised on every rank)."""
        try:
            self._executor.write_versions(step, timeout_s)
        except Exception as exc:
            error = self._describe(exc)
            log.error(
                "trainer rank %d: writing version words of update %d failed: %s",
                self.rank,
                step,
                error,
            )
            return _Outcome(error=error, cause=exc)
        return _Outcome()

    def _roll_back(self, step: int, timeout_s: float) -> None:
        """Some words may read `step` already: set every word this rank wrote back to the
        last complete update, so no engine (no rank of a replica) shows a partial one."""
        try:
            self._executor.write_versions(self._committed_step, timeout_s)
        except Exception as exc:  # an engine that is gone keeps what it had
            log.warning(
                "trainer rank %d: rolling back version words of update %d: %s",
                self.rank,
                step,
                exc,
            )

    def _record(self, step: int, t0: float, stats: UpdateStats) -> None:
        """Keep the task records of the recent updates for `trace_events`."""
        if self.config.record_trace:
            self._records.append((step, t0 - self._t_created, stats.records))
            del self._records[:-16]

    def _describe(self, exc: BaseException) -> str:
        """One line naming this rank and the exception (its type unless it is one of ours)."""
        text = str(exc) if isinstance(exc, WeightTransferError) else f"{type(exc).__name__}: {exc}"
        who = f"trainer rank {self.rank}"
        return text if text.startswith(who) else f"{who}: {text}"

    def _peer_failure(self, step: int) -> Callable[[], str | None]:
        """For `Executor.run`: another rank's failure report for `step`, once one was published
        (heard by a blocking wait on a second connection: the executor's checks cost nothing)."""
        assert self._watch is not None
        return self._watch.watch(step)

    def trace_events(self) -> list[dict[str, Any]]:
        """Chrome/Perfetto events of the recent updates on this rank, one after another on one
        timeline (microseconds since this sender was made)."""
        events: list[dict[str, Any]] = []
        for step, start_s, records in self._records:
            events.extend(trace_events(records, rank=self.rank, step=step, start_s=start_s))
        return events

    def write_trace(self, path: str | Path) -> None:
        """Write `trace_events()` as a Chrome trace JSON file (open it in ui.perfetto.dev)."""
        Path(path).write_text(json.dumps({"traceEvents": self.trace_events()}))

    def close(self) -> None:
        """Release registrations and connections (and the controller this rank hosts, if it
        made it: it lingers, bounded, until the engines saw the last update)."""
        try:
            if self._presence is not None:
                self._presence.close()
            if self._watch is not None:
                self._watch.close()
            if self._barriers is not None:
                self._barriers.close()
            self._executor.close()
            if self._delta is not None:
                self._delta.close()
            self._transport.close()
        finally:
            if self._owns_controller and self.controller is not None:
                self.controller.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
