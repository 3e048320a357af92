"""Whole updates between real processes: FSDP2 trainers (gloo) -> tensor-parallel engines.

3 trainer ranks shard a transformers Llama with FSDP2 (shapes that do not divide by 3); 2 engine
ranks hold a tp=2 vLLM-layout copy. Between updates the trainer takes real AdamW steps. After each
of 3 updates every engine tensor must equal the reference materialization of the trainer's full
weights exactly (FP8: the reference quantizer's bytes). Every backend that can run here is tried.
"""

from __future__ import annotations

import pytest
import torch

from tests.markers import backend_unavailable_reason
from tests.unit.test_plan import engine_manifest, fsdp_sources
from weight_transfer.cli.run_demo import DemoConfig, run_demo
from weight_transfer.planner.plan import PlannerConfig, plan
from weight_transfer.planner.presets.models import get_model_shape, hf_parameter_shapes
from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
from weight_transfer.planner.types import QuantWrite

BACKENDS = ["loopback", "tcp", "ucx", "nixl"]


def backend_param(name: str):
    reason = backend_unavailable_reason(name)
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


def _check(result, steps: int, engines: int) -> None:
    assert not result.errors, result.errors
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    assert [u.step for u in result.updates] == list(range(1, steps + 1))
    assert all(not u.mismatches for u in result.updates), [u.mismatches for u in result.updates]
    for step in range(1, steps + 1):
        for e in range(engines):
            got = result.engine_tensors[step][e]
            want = result.expected[step][e]
            assert set(got) == set(want)
            for name in want:
                assert torch.equal(
                    got[name].view(torch.uint8), want[name].contiguous().view(torch.uint8)
                ), f"step {step} engine {e} tensor {name}"
    # The optimizer really changed the weights between updates.
    name = "model.layers.0.self_attn.o_proj.weight"
    assert not torch.equal(
        result.expected[1][0][name].float(), result.expected[steps][0][name].float()
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_fsdp2_trainers_update_tp2_engines(backend: str, fp8: bool) -> None:
    cfg = DemoConfig(
        backend=backend,
        fp8=fp8,
        train_ranks=3,
        engine_ranks=2,
        steps=3,
        trainer_dtype="float32" if fp8 else "bfloat16",
        return_tensors=True,
        timeout_s=240,
    )
    _check(run_demo(cfg), cfg.steps, cfg.engine_ranks)


@pytest.mark.timeout(600)
def test_fp8_units_quantized_from_the_trainers_own_shards() -> None:
    """Two FSDP2 ranks, tp=2 engines: the tiny model's o_proj and down_proj units span both
    ranks' shards, split on a block row (128 of 256 rows), so each rank quantizes its own rows
    from its own shard with no gather (the other units lie in one rank's shards already); every
    engine byte must equal the reference quantizer's of the whole tensor, after real steps."""
    shape = get_model_shape("tiny")
    sources = fsdp_sources(hf_parameter_shapes(shape), 2, "float32")
    dests = [
        engine_manifest(
            f"engine{e}",
            vllm_recipes(shape, e, 2, fp8=True),
            vllm_tensor_specs(shape, e, 2, fp8=True),
        )
        for e in range(2)
    ]

    def rows_by_rank(schedule, dest: str) -> set[tuple[int, str, tuple[int, int]]]:
        return {
            (r.rank, t.kind, w.dest_box[0])
            for r in schedule.ranks
            for t in r.tasks
            for w in t.writes
            if isinstance(w, QuantWrite) and w.dest == dest and w.engine == "engine0"
        }

    banded = plan(sources, dests)
    gathered = plan(sources, dests, PlannerConfig(quantize_in_shards=False))
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        dest = f"model.layers.0.{name}"
        assert rows_by_rank(banded, dest) == {(0, "direct", (0, 128)), (1, "direct", (128, 256))}
        assert {k for _, k, _ in rows_by_rank(gathered, dest)} == {"gather"}
    assert not any(t.kind == "gather" for r in banded.ranks for t in r.tasks)
    cfg = DemoConfig(
        backend="loopback",
        fp8=True,
        train_ranks=2,
        engine_ranks=2,
        steps=2,
        trainer_dtype="float32",
        return_tensors=True,
        timeout_s=240,
    )
    _check(run_demo(cfg), cfg.steps, cfg.engine_ranks)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", [backend_param(b) for b in ("loopback", "tcp")])
def test_cast_from_float32_trainer(backend: str) -> None:
    cfg = DemoConfig(
        backend=backend,
        train_ranks=2,
        engine_ranks=2,
        steps=2,
        trainer_dtype="float32",
        return_tensors=True,
        timeout_s=240,
    )
    _check(run_demo(cfg), cfg.steps, cfg.engine_ranks)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", [backend_param(b) for b in ("loopback", "tcp")])
def test_llama_trainer_updates_phi3_engine_logits_match(backend: str) -> None:
    """A real model library on both sides: fused qkv_proj/gate_up_proj in Phi3 from Llama."""
    cfg = DemoConfig(
        backend=backend,
        train_ranks=3,
        engine_ranks=1,
        steps=2,
        trainer_dtype="float32",
        engine_dtype="float32",
        engine_model="phi3",
        timeout_s=240,
    )
    result = run_demo(cfg)
    assert result.ok, result.errors
    for step in (1, 2):
        engine = result.logits["engine"][step]
        trainer = result.logits["trainer"][step]
        assert engine.shape == trainer.shape
        torch.testing.assert_close(engine, trainer, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(result.logits["trainer"][1], result.logits["trainer"][2])
