"""vLLM: both halves of the plug-in, in one place.

- `weight_transfer.engines.vllm.trainer` (re-exported here): the trainer side of vLLM's RL
  protocol (`OneSidedUpdater`, the init infos, `LLMWeightSyncClient`). It imports no vLLM, so a
  trainer process without vLLM installed imports this package.
- `weight_transfer.engines.vllm.worker`: the worker side, loaded in every vLLM process by the
  `vllm.general_plugins` entry point (`worker:register`); it imports vLLM.

Importing this package never imports vLLM.
"""

from __future__ import annotations

from weight_transfer.engines.vllm.trainer import (
    BACKEND,
    ControlPlaneConfig,
    EngineInitInfo,
    EngineUpdateInfo,
    LLMWeightSyncClient,
    OneSidedUpdater,
    TrainerInitInfo,
    TransferConfig,
    VllmConfig,
    WeightSyncClient,
)

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
