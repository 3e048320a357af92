"""The trainer side of the vLLM weight-transfer protocol, without importing vLLM.

vLLM's RL protocol has four phases (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`), reached through any object with those four methods
(vLLM calls it a `VLLMWeightSyncClient`: the HTTP routes, Ray actors, or `LLMWeightSyncClient`
below for an in-process `vllm.LLM`). `OneSidedUpdater` maps them onto this project's
`Controller` and `WeightSender`:

1. once: trainer rank 0 hosts the control plane (`Controller`) and calls
   `init_weight_transfer_engine` with an `EngineInitInfo` (address, token, session): every vLLM
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
vLLM's `TrainerWeightTransferEngine` for those that have vLLM.
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

from weight_transfer.backends.base import TransportConfig
from weight_transfer.config import (
    ControllerConfig,
    ControlPlaneConfig,
    DeltaConfig,
    SenderConfig,
)
from weight_transfer.controller import Controller
from weight_transfer.errors import ConfigurationError, TransportTimeoutError, WeightTransferError
from weight_transfer.pipeline import UpdateStats
from weight_transfer.sender import WeightSender

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

    Plain JSON-safe values only: it travels over vLLM's RPC or HTTP route as a dict.
    """

    host: str
    """Address of the control plane (trainer rank 0 hosts it)."""
    port: int
    """TCP port of the control plane."""
    token: str
    """Shared secret of the control plane (at least 8 characters)."""
    session: str = "default"
    """Control-plane session (namespace)."""
    timeout_s: float = 60.0
    """Longest any control-plane wait may take on the engine side."""
    transport: str = "loopback"
    """Backend name (loopback | tcp | ucx | nixl | ibverbs)."""
    transport_options: tuple[tuple[str, str], ...] = ()
    """Backend options (key, value)."""
    engine_prefix: str = "vllm"
    """Engine ranks are named `{engine_prefix}/rank{global worker rank}`."""
    publish_digests: bool = False
    """Verification mode: after each update every engine rank publishes a sha256 of every
    tensor it received (one read of all of them) for `Controller.verify`."""
    hf_moe_layout: str = "per_expert"
    """How the trainer holds MoE experts: "per_expert" (HF checkpoints) or "fused"
    (transformers >= 5 modules); see `planner.presets.models`."""
    patch_region_bytes: int = 0
    """Delta updates: bytes of the patch region each worker registers (0: none; full updates
    only). `update_weights` applies the patches (docs/delta.md)."""

    def __post_init__(self) -> None:
        if self.patch_region_bytes < 0:
            raise ValueError("patch_region_bytes must be >= 0")
        # Lists arrive from JSON: normalise to the frozen form.
        object.__setattr__(
            self, "transport_options", tuple((str(k), str(v)) for k, v in self.transport_options)
        )
        self.control()  # validates host, port, token, session, timeout
        if not self.engine_prefix or "/" in self.engine_prefix:
            raise ValueError("engine_prefix must be non-empty and contain no '/'")
        if self.hf_moe_layout not in ("per_expert", "fused"):
            raise ValueError(
                f"hf_moe_layout must be per_expert or fused, got {self.hf_moe_layout!r}"
            )

    def control(self) -> ControlPlaneConfig:
        """The `ControlPlaneConfig` this describes."""
        return ControlPlaneConfig(
            host=self.host,
            port=self.port,
            token=self.token,
            session=self.session,
            timeout_s=self.timeout_s,
        )

    def transport_config(self) -> TransportConfig:
        """The `TransportConfig` this describes."""
        listen = "127.0.0.1" if self.host == "localhost" else self.host
        return TransportConfig(
            name=self.transport, listen_host=listen, options=self.transport_options
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form for `init_weight_transfer_engine`."""
        d = dataclasses.asdict(self)
        d["transport_options"] = [list(kv) for kv in self.transport_options]
        return d


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
    """Trainer-side settings of one update stream into one vLLM deployment.

    Frozen and standalone (vLLM's own `TrainerInitInfo` base is a mutable dataclass, and a frozen
    dataclass cannot derive from it); `backend` and `is_sender` are what vLLM's factory reads.
    """

    backend: ClassVar[str] = BACKEND
    rank: int
    """This trainer process's rank (rank 0 hosts the control plane and drives vLLM)."""
    world_size: int
    """Trainer ranks (every one calls `update`)."""
    num_engines: int
    """vLLM worker processes that receive (tensor-parallel size times data-parallel replicas)."""
    host: str = "127.0.0.1"
    """Address rank 0 hosts the control plane on, reachable from the vLLM workers."""
    port: int = 29700
    """TCP port of the control plane."""
    token: str
    """Shared secret (at least 8 characters)."""
    session: str = "default"
    """Control-plane session (namespace)."""
    timeout_s: float = 120.0
    """Longest a control-plane wait may take (joins, plan)."""
    update_timeout_s: float = 300.0
    """Longest one update may take."""
    transport: str = "loopback"
    """Backend name."""
    transport_options: tuple[tuple[str, str], ...] = ()
    """Backend options (key, value)."""
    memory_budget_bytes: int = 1 << 30
    """Per-rank temporary memory of the sender."""
    engine_prefix: str = "vllm"
    """Engine-rank name prefix (one per vLLM deployment sharing a control plane)."""
    publish_digests: bool = False
    """Engines publish per-tensor digests after each update (`EngineInitInfo.publish_digests`)."""
    hf_moe_layout: str = "per_expert"
    """How this trainer holds MoE experts (`EngineInitInfo.hf_moe_layout`)."""
    delta_enabled: bool = False
    """Delta updates (`DeltaConfig.enabled`); needs `patch_region_bytes` > 0."""
    delta_anchor_every_updates: int = 0
    """A full update every this many updates (`DeltaConfig.anchor_every_updates`)."""
    patch_region_bytes: int = 0
    """Patch region each vLLM worker registers (`EngineInitInfo.patch_region_bytes`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.num_engines < 1:
            raise ValueError("num_engines must be >= 1")
        if self.update_timeout_s <= 0:
            raise ValueError("update_timeout_s must be positive")
        self.engine_init_info()  # validates the shared fields

    @property
    def is_sender(self) -> bool:
        """Rank 0 drives the vLLM phases."""
        return self.rank == 0

    def engine_init_info(self) -> EngineInitInfo:
        """The `EngineInitInfo` rank 0 sends to the vLLM workers."""
        return EngineInitInfo(
            host=self.host,
            port=self.port,
            token=self.token,
            session=self.session,
            timeout_s=self.timeout_s,
            transport=self.transport,
            transport_options=self.transport_options,
            engine_prefix=self.engine_prefix,
            publish_digests=self.publish_digests,
            hf_moe_layout=self.hf_moe_layout,
            patch_region_bytes=self.patch_region_bytes,
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
        control = init_info.engine_init_info().control()
        self.controller: Controller | None = None
        if self.is_sender:
            self.controller = Controller(
                ControllerConfig(
                    num_trainer_ranks=init_info.world_size, num_engines=init_info.num_engines
                ),
                control,
            )
            assert client is not None
            try:
                client.init_weight_transfer_engine(init_info.engine_init_info().to_dict())
            except Exception as exc:
                self.controller.close()
                raise WeightTransferError(
                    f"vLLM did not join the transfer (init_weight_transfer_engine): {exc}"
                ) from exc
        self.sender = WeightSender(
            params,
            rank=init_info.rank,
            world_size=init_info.world_size,
            transport=init_info.engine_init_info().transport_config(),
            control=control,
            controller=self.controller,
            config=SenderConfig(
                memory_budget_bytes=init_info.memory_budget_bytes,
                update_timeout_s=init_info.update_timeout_s,
                delta=DeltaConfig(
                    enabled=init_info.delta_enabled,
                    anchor_every_updates=init_info.delta_anchor_every_updates,
                    apply_timeout_s=init_info.update_timeout_s,
                ),
            ),
        )
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
            WeightTransferError: vLLM refused a phase (its message), or the transfer failed
                (the failing rank and peer named); the engine's version does not advance.
            TransportTimeoutError: an engine did not get ready in time.
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
        timeout = self.init_info.update_timeout_s
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
            raise WeightTransferError(f"update {step}: vLLM's update_weights failed: {errors[0]}")
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
                raise WeightTransferError(
                    f"update {step}: vLLM's update_weights ended before every engine was "
                    f"ready: {errors[0] if errors else 'no error reported'}"
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
