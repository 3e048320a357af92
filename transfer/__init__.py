"""weight-transfer: move RL trainer weights into inference-engine memory with one-sided writes.

The names below are the public API; everything else under `weight_transfer` may change.
Importing this package never imports a concrete backend (ucx, nixl, pyverbs) or vLLM.

Engine side::

    from weight_transfer import (ControlPlaneConfig, TransportConfig, WeightReceiver,
                                 allocate_engine_tensors, get_model_shape, vllm_recipes,
                                 vllm_tensor_specs)

Trainer side::

    from weight_transfer import Controller, ControllerConfig, SenderConfig, WeightSender
"""

from __future__ import annotations

from weight_transfer.backends.base import TransportConfig
from weight_transfer.config import (
    ControllerConfig,
    ControlPlaneConfig,
    DeltaConfig,
    ReceiverConfig,
    SenderConfig,
    TransferConfig,
    load_toml,
)
from weight_transfer.controller import Controller
from weight_transfer.errors import (
    ConfigurationError,
    ControlPlaneAuthError,
    PeerLostError,
    PlanMismatchError,
    TransportError,
    TransportTimeoutError,
    TransportUnavailableError,
    UpdateAbortedError,
    WeightTransferError,
)
from weight_transfer.manifest import allocate_engine_tensors
from weight_transfer.planner.presets.models import (
    MODEL_SHAPES,
    ModelShape,
    from_hf_config,
    get_model_shape,
)
from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

__version__ = "0.1.0"

__all__ = [
    "MODEL_SHAPES",
    "ConfigurationError",
    "ControlPlaneAuthError",
    "ControlPlaneConfig",
    "Controller",
    "ControllerConfig",
    "DeltaConfig",
    "ModelShape",
    "PeerLostError",
    "PlanMismatchError",
    "ReceiverConfig",
    "SenderConfig",
    "TransferConfig",
    "TransportConfig",
    "TransportError",
    "TransportTimeoutError",
    "TransportUnavailableError",
    "UpdateAbortedError",
    "WeightReceiver",
    "WeightSender",
    "WeightTransferError",
    "allocate_engine_tensors",
    "from_hf_config",
    "get_model_shape",
    "load_toml",
    "vllm_recipes",
    "vllm_tensor_specs",
]
