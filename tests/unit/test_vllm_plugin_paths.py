"""The vLLM plug-in's parts that a GPU engine exercises, checked where they can be without one.

What runs on a GPU only (CUDA graphs, vLLM's Hopper FP8 kernels) is in docs/vllm.md, "vLLM on a
GPU"; these tests pin the logic those paths rely on: which quantization configs are accepted,
how a refresh puts vLLM's re-derived tensors back into the storage the engine started with, and
the client's weight version on a vLLM without one.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from tests.markers import requires_module

pytestmark = requires_module("vllm")


def _vllm_config(quantization: str | None, quantization_config: Any = None) -> Any:
    hf = types.SimpleNamespace(quantization_config=quantization_config)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(quantization=quantization, hf_config=hf)
    )


def test_block_fp8_is_accepted_and_other_quantizations_are_refused() -> None:
    from weight_transfer.engines.vllm import _fp8_block
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
    from weight_transfer.engines.vllm import OneSidedWeightTransferEngine

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


class _Engine026:
    """vLLM 0.26's LLMEngine as the client sees it: no weight version."""

    def __init__(self) -> None:
        self.calls: list[str] = []


class _Llm026:
    def __init__(self) -> None:
        self.llm_engine = _Engine026()
        self.calls: list[Any] = []

    def sleep(self, level: int, mode: str) -> None:
        self.calls.append(("sleep", level, mode))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: str, kwargs: Any = None) -> list[Any]:
        self.calls.append(("rpc", method))
        return [None]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def test_client_keeps_the_version_where_vllm_has_none() -> None:
    from weight_transfer.vllm import LLMWeightSyncClient

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
    from weight_transfer.errors import NotServingError
    from weight_transfer.serving import ServingState
    from weight_transfer.vllm import LLMWeightSyncClient

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
