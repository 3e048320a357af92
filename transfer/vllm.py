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
   thread: inside that call every vLLM worker announces that it is ready and blocks (bounded)
   until its version word reads k. Only when every worker is ready does rank 0 post "go k", so
   every one-sided write lands while each worker's only thread is inside that call and no
   forward pass runs (vLLM runs a worker's RPCs and its model steps on one thread, in order).
   `finish_weight_update(str(k))` then re-runs vLLM's processing where it derives kernel
   state from the weights, and sets the weight version.

Trainer processes without vLLM installed use this module directly with any client object (for
example one posting to vLLM's HTTP routes); `weight_transfer.engines.vllm` wraps it as
vLLM's `TrainerWeightTransferEngine` for those that have vLLM. This module never imports vLLM
and re-exports the configuration classes a vLLM user needs, so one import serves:

    from weight_transfer.vllm import (ControlPlaneConfig, LLMWeightSyncClient,
                                      OneSidedUpdater, TrainerInitInfo, TransferConfig)

Settings all come from the transfer's one `TransferConfig` (its `[vllm]` table holds the
plug-in's own); `TrainerInitInfo` and `EngineInitInfo` are derived from it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
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
    TransportTimeoutError,
    UpdateFailedError,
    WeightTransferError,
)
from weight_transfer.pipeline import UpdateStats
from weight_transfer.sender import WeightSender

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

_READY_POLL_S = 0.01


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """An engine rank is inside `update_weights` for `step` (no forward pass runs on it)."""

    step: int
    engine: str


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
        """The `EngineInitInfo` rank 0 sends to the vLLM workers."""
        return EngineInitInfo.from_config(self.config)


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

    vLLM 0.26 has no weight version on its engine and no `shutdown_weight_transfer_engine` on
    its workers: there the version is kept by this client, and leaving the transfer happens when
    the engine shuts down (its workers shut their weight-transfer engine down then).
    """

    def __init__(self, llm: Any) -> None:
        """Args: llm: a `vllm.LLM` started with `weight_transfer_config={"backend": BACKEND}`."""
        self.llm = llm
        self._version = "0"

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every worker joins (vLLM worker method `init_weight_transfer_engine`)."""
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        """Pause scheduling (requests kept), then every worker starts an update session."""
        self.llm.sleep(level=0, mode="keep")
        try:
            self.llm.collective_rpc("start_weight_update")
        except BaseException:
            self.llm.wake_up(tags=["scheduling"])
            raise

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Every worker waits (bounded) until the update's writes are complete."""
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every worker records the update; prefix cache reset; version set; scheduling resumed."""
        try:
            self.llm.collective_rpc("finish_weight_update")
            self.llm.reset_prefix_cache()
            if weight_version is not None:
                self._version = weight_version
                set_version = getattr(self.llm.llm_engine, "set_weight_version", None)
                if set_version is not None:  # vLLM 0.27 and later
                    set_version(weight_version)
        finally:
            self.llm.wake_up(tags=["scheduling"])

    def abort_weight_update(self) -> None:
        """Resume scheduling after a failed update (the engine keeps its previous version)."""
        self.llm.wake_up(tags=["scheduling"])

    def shutdown_weight_transfer_engine(self) -> None:
        """Every worker leaves the transfer (inference goes on); on vLLM 0.26, which has no such
        worker method, nothing happens until the engine shuts down."""
        if _workers_can_shut_down_transfer():
            self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def get_weight_version(self) -> str:
        """The engine's weight version (on vLLM 0.26: the last one this client finished)."""
        get_version = getattr(self.llm.llm_engine, "get_weight_version", None)
        return str(get_version()) if get_version is not None else self._version


def _workers_can_shut_down_transfer() -> bool:
    """Whether vLLM's workers have `shutdown_weight_transfer_engine` (0.27 and later).

    Only called beside an in-process `vllm.LLM`, so vLLM is importable; its worker classes
    derive from the GPU worker, which is what is asked.
    """
    import importlib

    worker = importlib.import_module("vllm.v1.worker.gpu_worker").Worker
    return hasattr(worker, "shutdown_weight_transfer_engine")


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
            WeightTransferError: vLLM refused to join (its message), or the plan failed.
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

    @property
    def engines(self) -> list[str]:
        """Names of the engine ranks (rank 0 only)."""
        assert self.controller is not None
        return sorted(self.controller.joins)

    def update(self, step: int | None = None) -> UpdateStats:
        """Send the current weights into vLLM as update `step` (default: last + 1). Collective.

        Returns after vLLM finished the update (rank 0: `finish_weight_update` returned, the
        engine's weight version reads `str(step)`).

        Raises:
            UpdateFailedError: the transfer failed (the failing rank and peer named) or vLLM's
                `update_weights` failed; the engine's version does not advance, and a later
                update may retry.
            TransportTimeoutError: an engine did not get ready in time.
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
        client.start_weight_update()
        try:
            stats = self._transfer(step, client, timeout)
        except BaseException:
            abort = getattr(client, "abort_weight_update", None)
            if abort is not None:
                abort()
            raise
        t0 = time.perf_counter()
        client.finish_weight_update(str(step))
        log.info("update %d: vLLM finish_weight_update took %.3f s", step, time.perf_counter() - t0)
        return stats

    def _transfer(self, step: int, client: WeightSyncClient, timeout: float) -> UpdateStats:
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                client.update_weights({"version": step, "timeout_s": timeout})
            except BaseException as exc:  # reported by the caller's thread
                errors.append(exc)

        th = threading.Thread(target=receive, name=f"wt-vllm-update-{step}", daemon=True)
        th.start()
        self._wait_ready(step, th, errors, timeout)
        try:
            stats = self.sender.update(step)
        finally:
            th.join(timeout)
        if th.is_alive():
            raise TransportTimeoutError(
                f"update {step}: vLLM's update_weights did not return within {timeout:.0f} s"
            )
        if errors:
            raise UpdateFailedError(
                f"update {step}: vLLM's update_weights failed: {errors[0]}", step=step
            )
        return stats

    def _wait_ready(
        self, step: int, th: threading.Thread, errors: list[BaseException], timeout_s: float
    ) -> None:
        assert self.controller is not None
        cp = self.controller.control
        engines = self.engines
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [e for e in engines if not cp.exists(ready_key(step, e))]
            if not missing:
                for e in engines:
                    cp.delete(ready_key(step, e))
                return
            if errors or not th.is_alive():
                th.join(1.0)
                raise UpdateFailedError(
                    f"update {step}: vLLM's update_weights ended before every engine was "
                    f"ready: {errors[0] if errors else 'no error reported'}",
                    step=step,
                )
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"update {step}: engine(s) {missing} not ready within {timeout_s:.0f} s"
                )
            time.sleep(_READY_POLL_S)

    def close(self) -> None:
        """Release the sender (and the control plane on rank 0)."""
        self.sender.close()
        if self.controller is not None:
            self.controller.close()

    def __enter__(self) -> OneSidedUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
