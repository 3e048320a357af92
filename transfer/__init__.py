"""weight-transfer: move RL trainer weights into inference-engine memory with one-sided writes.

The names below are the public API; everything else under `weight_transfer` may change
(`weight_transfer.engines.vllm` is public too: what a vLLM user imports). Importing this
package never imports a concrete backend (ucx, nixl, pyverbs) or vLLM.

One config (`TransferConfig`, or `load_toml` of a file that maps onto it) for both sides.

Engine side::

    layout = VllmLayout(hf_config, tp_rank, tp_size)
    receiver = WeightReceiver(layout.allocate(), layout, config, engine=f"tp{tp_rank}")

Trainer side (every rank; rank 0 hosts the controller itself)::

    sender = WeightSender(model, config)
    sender.update(step)

Advanced: `Controller` / `ControllerConfig` (a controller made by hand), `TransportConfig` (a
process's own transport settings), the recipe presets (`vllm_recipes`, `vllm_tensor_specs`).
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
    VllmConfig,
    load_toml,
)
from weight_transfer.controller import Controller
from weight_transfer.errors import (
    ConfigurationError,
    ControlPlaneAuthError,
    NotServingError,
    PeerLostError,
    PlanMismatchError,
    TransportError,
    TransportTimeoutError,
    TransportUnavailableError,
    UpdateAbortedError,
    UpdateFailedError,
    UpdateInProgressError,
    WeightTransferError,
)
from weight_transfer.layouts import Layout, VllmLayout
from weight_transfer.manifest import allocate_engine_tensors
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.presets.models import (
    MODEL_SHAPES,
    ModelShape,
    from_hf_config,
    get_model_shape,
    hf_parameter_shapes,
)
from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
from weight_transfer.planner.reference import materialize
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender
from weight_transfer.serving import ServingGate, ServingState, ServingStatus

__version__ = "0.1.0"

__all__ = [
    "MODEL_SHAPES",
    "ConfigurationError",
    "ControlPlaneAuthError",
    "ControlPlaneConfig",
    "Controller",
    "ControllerConfig",
    "Layout",
    "DeltaConfig",
    "ModelShape",
    "NotServingError",
    "PeerLostError",
    "PlanMismatchError",
    "PlannerConfig",
    "ReceiverConfig",
    "SenderConfig",
    "ServingGate",
    "ServingState",
    "ServingStatus",
    "TransferConfig",
    "TransportConfig",
    "TransportError",
    "TransportTimeoutError",
    "TransportUnavailableError",
    "UpdateAbortedError",
    "UpdateFailedError",
    "VllmConfig",
    "VllmLayout",
    "UpdateInProgressError",
    "WeightReceiver",
    "WeightSender",
    "WeightTransferError",
    "allocate_engine_tensors",
    "from_hf_config",
    "get_model_shape",
    "hf_parameter_shapes",
    "load_toml",
    "materialize",
    "vllm_recipes",
    "vllm_tensor_specs",
]
