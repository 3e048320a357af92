"""The vLLM plug-in's parts that a GPU engine exercises, checked where they can be without one.

What runs on a GPU only (CUDA graphs, vLLM's Hopper FP8 kernels) is in docs/vllm.md, "vLLM on a
GPU"; these tests pin the logic those paths rely on: which quantization configs are accepted,
how a refresh puts vLLM's re-derived tensors back into the storage the engine started with, and
the client's weight version on a vLLM without one.
"""

from __future__ import annotations

import secrets
import threading
import time
import types
from typing import Any

import pytest
import torch
from torch import nn

from tests.markers import requires_module
from weight_transfer.spans import SpanLog

pytestmark = requires_module("vllm")


def _vllm_config(quantization: str | None, quantization_config: Any = None) -> Any:
    hf = types.SimpleNamespace(quantization_config=quantization_config)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(quantization=quantization, hf_config=hf)
    )


def test_block_fp8_is_accepted_and_other_quantizations_are_refused() -> None:
    from weight_transfer.engines.vllm.worker import _fp8_block
    from weight_transfer.errors import ConfigurationError

    assert _fp8_block(_vllm_config(None)) is None
    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert _fp8_block(_vllm_config("fp8", block)) == (128, 128)
    assert _fp8_block(_vllm_config("fp8", types.SimpleNamespace(**block))) == (128, 128)
    for quant, cfg, words in (
        ("fp8", {"quant_method": "fp8"}, "weight_block_size None"),
        ("fp8", {"weight_block_size": [64, 64]}, "[64, 64]"),
        ("awq", {"weight_block_size": [128, 128]}, "'awq'"),
        ("fp8", {**block, "activation_scheme": "static"}, "static activation"),
    ):
        with pytest.raises(ConfigurationError, match="nothing was registered") as err:
            _fp8_block(_vllm_config(quant, cfg))
        assert words in str(err.value)


class _Relayout:
    """A quant method whose processing derives a re-laid-out scale from the checkpoint one and
    re-wraps the weight, the way vLLM's `replace_parameter` does (DeepGEMM on Hopper)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale_inv.detach()
        derived = torch.empty_strided(scale.shape, (1, scale.shape[0]))  # column-major
        derived.copy_(scale * 2)
        layer.weight_scale_inv = nn.Parameter(derived, requires_grad=False)
        layer.weight = nn.Parameter(layer.weight.detach().view(layer.weight.shape), False)


def _engine_over(layer: nn.Module) -> Any:
    from weight_transfer.engines.vllm.worker import OneSidedWeightTransferEngine

    engine: Any = object.__new__(OneSidedWeightTransferEngine)
    engine._captured = {"layer": dict(layer.named_parameters(recurse=False))}
    return engine


def test_refresh_writes_derived_values_into_the_loaded_storage() -> None:
    layer = nn.Module()
    layer.quant_method = _Relayout()
    layer.weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(
        torch.empty_strided((2, 3), (1, 2)).copy_(torch.randn(2, 3)), requires_grad=False
    )
    loaded_weight, loaded_scale = layer.weight, layer.weight_scale_inv
    engine = _engine_over(layer)
    checkpoint_scale = torch.randn(2, 3)
    # As the refresh does for a buffered parameter: processing reads the checkpoint layout.
    layer.weight_scale_inv = nn.Parameter(checkpoint_scale.clone(), requires_grad=False)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight_scale_inv.data_ptr() != loaded_scale.data_ptr()
    engine._restore_captured("layer", layer)
    assert layer.weight is loaded_weight and layer.weight_scale_inv is loaded_scale
    assert torch.equal(loaded_scale, checkpoint_scale * 2)


def test_refresh_that_changes_a_layout_keeps_vllms_tensor_on_the_cpu() -> None:
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
    engine = _engine_over(layer)
    layer.weight = nn.Parameter(torch.randn(6, 4), requires_grad=False)  # other shape
    replaced = layer.weight
    engine._restore_captured("layer", layer)
    assert layer.weight is replaced  # no CUDA graph reads the old one on the CPU


def test_refresh_that_drops_a_parameter_fails() -> None:
    from weight_transfer.errors import WeightTransferError

    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
    engine = _engine_over(layer)
    del layer.weight
    with pytest.raises(WeightTransferError, match="dropped 'weight'"):
        engine._restore_captured("layer", layer)


def test_ue8m0_scales_are_told_from_a_trainers() -> None:
    """DeepGEMM's UE8M0 re-quantization leaves power-of-two scales (or exponent bytes); the
    reference quantizer's scales (amax / 448) are not."""
    from weight_transfer.engines.vllm.worker import _power_of_two_scales
    from weight_transfer.planner.fp8 import quantize_fp8_blockwise

    g = torch.Generator().manual_seed(3)
    _, trainer_scales = quantize_fp8_blockwise(torch.randn(384, 256, generator=g))
    assert not _power_of_two_scales(trainer_scales)
    ue8m0 = torch.exp2(torch.ceil(torch.log2(trainer_scales)))
    assert _power_of_two_scales(ue8m0)
    assert _power_of_two_scales(torch.full((3, 2), 127, dtype=torch.uint8))
    assert not _power_of_two_scales(torch.empty(0))
    mixed = ue8m0.clone()
    mixed[0, 0] = trainer_scales[0, 0]
    assert not _power_of_two_scales(mixed)


def _delta_engine(layer: nn.Module, *, delta: bool) -> Any:
    """A plug-in engine over one re-processed layer whose weight is registered in place."""
    from weight_transfer.engines.vllm.worker import (
        IN_PLACE_REPROCESS,
        OneSidedWeightTransferEngine,
        ParamPath,
    )

    model = nn.Module()
    model.layer = layer
    engine: Any = object.__new__(OneSidedWeightTransferEngine)
    engine.model = model
    engine.paths = {"layer.weight": ParamPath("layer.weight", IN_PLACE_REPROCESS, "layer")}
    engine._targets = {"layer.weight": layer.weight.data}
    engine._buffers, engine._rederive, engine.derived = {}, [], {}
    engine._reprocess = ["layer"]
    engine._captured = {"layer": dict(layer.named_parameters(recurse=False))}
    engine._delta, engine._rewrite_checked = delta, False
    engine.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=None))
    engine.global_rank = 0
    engine.spans = SpanLog("test worker")
    return engine


class _RequantInPlace:
    """Processing that rewrites the layer's weight in place (as DeepGEMM's UE8M0 requant)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight.data.mul_(0.5)


class _Keeps:
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


def test_delta_refresh_refuses_processing_that_rewrites_registered_bytes() -> None:
    """In delta mode the first refresh checks that vLLM's processing left every registered
    byte as written; a rewrite in place fails the update naming the parameter. Full updates
    (no patch region) rewrite every byte each time and need no check."""
    from weight_transfer.errors import WeightTransferError

    def layer(method: Any) -> nn.Module:
        m = nn.Module()
        m.quant_method = method
        m.weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
        return m

    with pytest.raises(WeightTransferError, match="rewrote the registered 'layer.weight'"):
        _delta_engine(layer(_RequantInPlace()), delta=True)._refresh()
    _delta_engine(layer(_RequantInPlace()), delta=False)._refresh()
    keeps = _delta_engine(layer(_Keeps()), delta=True)
    keeps._refresh()
    assert keeps._rewrite_checked


def test_delta_is_turned_off_where_vllm_requantizes_to_ue8m0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine whose FP8 layers vLLM re-quantizes to power-of-two scales registers no patch
    region: its trainers send it full updates. Other engines keep the configured one. Known
    from vLLM (`is_deep_gemm_e8m0_used`) or, where it cannot say, from the live scales."""
    from weight_transfer.config import ControlPlaneConfig, ReceiverConfig, TransferConfig
    from weight_transfer.engines.vllm import worker as plugin

    monkeypatch.setattr(plugin, "_deep_gemm_e8m0", lambda: False)

    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(256, 256), requires_grad=False)
    engine = _delta_engine(layer, delta=True)
    engine.global_rank = 0
    config = TransferConfig(
        control=ControlPlaneConfig(port=29700, token=secrets.token_hex(16)),
        receiver=ReceiverConfig(patch_region_bytes=1 << 20),
    )
    layer.weight_scale_inv = nn.Parameter(torch.rand(2, 2) + 0.1, requires_grad=False)
    engine._captured = {"layer": dict(layer.named_parameters(recurse=False))}
    engine._requantized = engine._requantized_layers()
    assert engine._requantized == []
    assert engine._delta_config(config) is config
    layer.weight_scale_inv.data.copy_(torch.tensor([[0.5, 0.25], [1.0, 2.0**-9]]))
    engine._requantized = engine._requantized_layers()
    assert engine._requantized == ["layer"]
    off = engine._delta_config(config)
    assert off.receiver.patch_region_bytes == 0 and off.control == config.control
    layer.weight_scale_inv.data.copy_(torch.rand(2, 2) + 0.1)
    monkeypatch.setattr(plugin, "_deep_gemm_e8m0", lambda: True)
    assert engine._requantized_layers() == ["layer"]


class _Engine026:
    """vLLM 0.26's LLMEngine as the client sees it: no weight version."""

    def __init__(self) -> None:
        self.calls: list[str] = []


class _Llm026:
    def __init__(self) -> None:
        self.llm_engine = _Engine026()
        self.calls: list[Any] = []
        self.threads: list[str] = []

    def sleep(self, level: int, mode: str) -> None:
        self.calls.append(("sleep", level, mode))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: str, timeout: Any = None, kwargs: Any = None) -> list[Any]:
        self.calls.append(("rpc", method))
        self.threads.append(threading.current_thread().name)
        return [None]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def test_client_keeps_the_version_where_vllm_has_none() -> None:
    from weight_transfer.engines.vllm import LLMWeightSyncClient

    llm = _Llm026()
    client = LLMWeightSyncClient(llm)
    assert client.get_weight_version() == "0"
    client.start_weight_update()
    client.update_weights({"version": 3})
    client.finish_weight_update("3")
    assert client.get_weight_version() == "3"
    assert llm.calls == [
        ("sleep", 0, "keep"),
        ("rpc", "start_weight_update"),
        ("rpc", "update_weights"),
        ("rpc", "finish_weight_update"),
        ("reset_prefix_cache",),
        ("wake_up", ["scheduling"]),
    ]


def test_client_stays_paused_after_a_failed_update_until_one_completes() -> None:
    """Fail closed, the client's part: after `fail_weight_update` (writes had begun) the
    scheduler is not woken, not even by an update that then fails before writing anything;
    only a finished update resumes it. An update that fails before writing, from a whole
    model, resumes at once."""
    from weight_transfer.engines.vllm import LLMWeightSyncClient
    from weight_transfer.errors import NotServingError
    from weight_transfer.serving import ServingState

    wake = ("wake_up", ["scheduling"])
    llm = _Llm026()
    client = LLMWeightSyncClient(llm)
    client.start_weight_update()
    client.update_weights({"version": 1})
    client.fail_weight_update("trainer rank 0: peer lost")
    assert wake not in llm.calls
    assert client.serving.state is ServingState.FAILED and client.serving.version == 0
    with pytest.raises(NotServingError, match="update 1 failed.*peer lost"):
        client.check_serving()
    client.start_weight_update()
    client.update_weights({"version": 2})
    client.abort_weight_update()  # nothing of 2 was written, but 1's bytes still are
    assert wake not in llm.calls and client.serving.state is ServingState.FAILED
    client.start_weight_update()
    client.update_weights({"version": 3})
    client.finish_weight_update("3")
    assert llm.calls[-1] == wake and client.check_serving() == 3
    llm.calls.clear()
    client.start_weight_update()
    client.update_weights({"version": 4})
    client.abort_weight_update()
    assert llm.calls[-1] == wake and client.check_serving() == 3


def test_client_overlaps_finish_with_the_refresh_and_resumes_only_after_success() -> None:
    """With `overlap_finish`, the workers' finish and the cache reset go out from a thread of
    their own once the commit is posted (vLLM queues them behind the running update_weights),
    finish_weight_update does not send them again, and scheduling resumes only then; after a
    failure the queued calls change nothing: no wake-up, FAILED."""
    from weight_transfer.engines.vllm import LLMWeightSyncClient
    from weight_transfer.serving import ServingState

    wake = ("wake_up", ["scheduling"])
    queued = [("rpc", "finish_weight_update"), ("reset_prefix_cache",)]
    llm = _Llm026()
    client = LLMWeightSyncClient(llm, overlap_finish=True)
    client.start_weight_update()
    client.update_weights({"version": 1})
    client.commit_posted(10.0)
    deadline = time.monotonic() + 10
    while llm.calls[-2:] != queued and time.monotonic() < deadline:
        time.sleep(0.005)
    assert llm.calls[-2:] == queued and llm.threads[-1] == "wt-vllm-finish"
    client.finish_weight_update("1")
    assert llm.calls[-3:] == [*queued, wake]
    assert client.check_serving() == 1 and client.get_weight_version() == "1"
    llm.calls.clear()
    client.start_weight_update()
    client.update_weights({"version": 2})
    client.commit_posted(10.0)
    client.fail_weight_update("engine rank 0: refresh failed")
    assert set(queued) <= set(llm.calls) and wake not in llm.calls
    assert client.serving.state is ServingState.FAILED


class _Counting:
    """A quant method that counts its processing calls."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1


# Named as vLLM's: off its CPU backend the processing of these does nothing.
UnquantizedLinearMethod = type("UnquantizedLinearMethod", (_Counting,), {})


class _CpuDispatch(_Counting):
    """vLLM's UnquantizedLinearMethod on its CPU backend: derives kernel state (an attribute)
    from the weight on every call."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.cpu_linear = object()


def test_processing_seen_to_do_nothing_is_not_run_again() -> None:
    """On a GPU vLLM's unquantized linears have nothing to re-process (the refresh of a
    Llama-3.1-8B, mostly such calls, took 3.9 ms per update on an H200): after the first
    refresh sees a layer's processing change nothing, later refreshes skip it. Processing that
    derives state (the CPU backend's GEMM dispatch, under the same class name), or of any other
    method, runs every time."""
    from weight_transfer.engines.vllm.worker import _may_be_noop

    def layer(method: Any) -> nn.Module:
        m = nn.Module()
        m.quant_method = method
        m.weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
        return m

    cpu_dispatch = type("UnquantizedLinearMethod", (_CpuDispatch,), {})
    for method, runs in (
        (UnquantizedLinearMethod(), 1),
        (cpu_dispatch(), 3),
        (_Counting(), 3),
    ):
        engine = _delta_engine(layer(method), delta=False)
        engine._noop_candidates = frozenset(
            m for m in engine._reprocess if _may_be_noop(engine.model.get_submodule(m))
        )
        for _ in range(3):
            engine._refresh()
        assert method.calls == runs, type(method).__mro__
        assert engine._skip_reprocess == (frozenset({"layer"}) if runs == 1 else frozenset())
