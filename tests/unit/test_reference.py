"""The reference materializer against hand-written torch.cat/chunk constructions, and its errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from weight_transfer.planner.fp8 import quantize_fp8_blockwise
from weight_transfer.planner.presets.models import ModelShape, get_model_shape, hf_parameter_shapes
from weight_transfer.planner.presets.vllm import DEFAULT_MOE_PREFIX, vllm_recipes, vllm_tensor_specs
from weight_transfer.planner.recipes import TensorSpec, identity
from weight_transfer.planner.reference import apply_recipe, check_coverage, materialize
from weight_transfer.planner.types import Part, Recipe


def hf_tensors(
    shape: ModelShape, *, seed: int, moe_layout: str = "per_expert"
) -> dict[str, torch.Tensor]:
    """Seeded random bf16 trainer tensors of varied magnitude (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, dims in hf_parameter_shapes(shape, moe_layout=moe_layout).items():  # type: ignore[arg-type]
        x = torch.randn(*dims, generator=g) * torch.exp(torch.randn(*dims, generator=g))
        out[name] = x.to(torch.bfloat16)
    return out


def expected_vllm_rank(
    shape: ModelShape, src: dict[str, torch.Tensor], rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """vLLM rank `rank` of `tp`, built independently with chunk/cat (bf16, no FP8)."""
    out: dict[str, torch.Tensor] = {}
    pad = -shape.vocab_size % 64
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = F.pad(src[name], (0, 0, 0, pad))
        per = padded.shape[0] // tp
        real = min(per, shape.vocab_size - rank * per)
        out[name] = padded.chunk(tp)[rank][:real]
    out["model.norm.weight"] = src["model.norm.weight"]
    kv_chunks = min(tp, shape.num_kv_heads)
    kv_idx = rank * kv_chunks // tp
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[a + "qkv_proj.weight"] = torch.cat(
            [
                src[a + "q_proj.weight"].chunk(tp)[rank],
                src[a + "k_proj.weight"].chunk(kv_chunks)[kv_idx],
                src[a + "v_proj.weight"].chunk(kv_chunks)[kv_idx],
            ]
        )
        out[a + "o_proj.weight"] = src[a + "o_proj.weight"].chunk(tp, dim=1)[rank]
        if shape.is_moe:
            e = shape.num_experts
            m = p + DEFAULT_MOE_PREFIX + "."
            out[m + "w13_weight"] = torch.stack(
                [
                    torch.cat(
                        [
                            src[f"{p}mlp.experts.{x}.gate_proj.weight"].chunk(tp)[rank],
                            src[f"{p}mlp.experts.{x}.up_proj.weight"].chunk(tp)[rank],
                        ]
                    )
                    for x in range(e)
                ]
            )
            out[m + "w2_weight"] = torch.stack(
                [
                    src[f"{p}mlp.experts.{x}.down_proj.weight"].chunk(tp, dim=1)[rank]
                    for x in range(e)
                ]
            )
            out[p + "mlp.gate.weight"] = src[p + "mlp.gate.weight"]
        else:
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [
                    src[p + "mlp.gate_proj.weight"].chunk(tp)[rank],
                    src[p + "mlp.up_proj.weight"].chunk(tp)[rank],
                ]
            )
            out[p + "mlp.down_proj.weight"] = src[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = src[p + norm]
    return out


@pytest.mark.parametrize(
    ("name", "tp"),
    [("tiny", 1), ("tiny", 2), ("tiny", 4), ("tiny", 8), ("tiny-moe", 1), ("tiny-moe", 2)],
)
def test_materialize_equals_hand_built_vllm_ranks(name: str, tp: int) -> None:
    shape = get_model_shape(name)
    src = hf_tensors(shape, seed=tp)
    for rank in range(tp):
        specs = vllm_tensor_specs(shape, rank, tp)
        got = materialize(vllm_recipes(shape, rank, tp), specs, src)
        want = expected_vllm_rank(shape, src, rank, tp)
        assert set(got) == set(want) == {s.name for s in specs}
        for key, tensor in want.items():
            assert got[key].dtype == torch.bfloat16
            assert torch.equal(got[key], tensor), f"{key} rank {rank}/{tp}"


def test_fused_trainer_experts_give_the_same_engine_tensors() -> None:
    """transformers>=5 stacked experts build the same vLLM tensors as per-expert ones."""
    shape = get_model_shape("tiny-moe")
    per = hf_tensors(shape, seed=7)
    fused = {k: v for k, v in per.items() if ".experts." not in k}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        e = range(shape.num_experts)
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([per[f"{p}{x}.gate_proj.weight"], per[f"{p}{x}.up_proj.weight"]]) for x in e]
        )
        fused[p + "down_proj"] = torch.stack([per[f"{p}{x}.down_proj.weight"] for x in e])
    for rank in range(2):
        for fp8 in (False, True):
            specs = vllm_tensor_specs(shape, rank, 2, fp8=fp8)
            a = materialize(vllm_recipes(shape, rank, 2, fp8=fp8), specs, per)
            b = materialize(
                vllm_recipes(shape, rank, 2, fp8=fp8, hf_moe_layout="fused"), specs, fused
            )
            assert a.keys() == b.keys()
            for key in a:
                assert (
                    torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8))
                    if a[key].dtype == torch.float8_e4m3fn
                    else torch.equal(a[key], b[key])
                ), key


def test_casts_between_float_dtypes() -> None:
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    got = materialize([identity("d", "s", (5, 3))], [TensorSpec("d", (5, 3), "bfloat16")], {"s": x})
    assert torch.equal(got["d"], x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="'d' \\(int32\\) cannot be built from 's' \\(float32\\)"):
        materialize([identity("d", "s", (5, 3))], [TensorSpec("d", (5, 3), "int32")], {"s": x})
    ints = torch.arange(15, dtype=torch.int32).reshape(5, 3)
    got = materialize([identity("d", "s", (5, 3))], [TensorSpec("d", (5, 3), "int32")], {"s": ints})
    assert torch.equal(got["d"], ints)


def test_materialize_errors_name_the_tensor() -> None:
    shape = get_model_shape("tiny")
    src = hf_tensors(shape, seed=3)
    recipes = vllm_recipes(shape, 0, 2)
    specs = vllm_tensor_specs(shape, 0, 2)
    missing = dict(src)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(
        ValueError,
        match="'model.layers.1.self_attn.qkv_proj.weight' needs source "
        "tensor 'model.layers.1.self_attn.k_proj.weight'",
    ):
        materialize(recipes, specs, missing)
    short = dict(src)
    short["model.layers.0.mlp.up_proj.weight"] = src["model.layers.0.mlp.up_proj.weight"][:300]
    with pytest.raises(
        ValueError,
        match="'model.layers.0.mlp.gate_up_proj.weight', source "
        "'model.layers.0.mlp.up_proj.weight'.*outside",
    ):
        materialize(recipes, specs, short)
    with pytest.raises(ValueError, match="recipe for 'model.norm.weight' has no destination spec"):
        materialize(recipes, [s for s in specs if s.name != "model.norm.weight"], src)
    wrong = [
        dataclasses.replace(s, shape=(100,)) if s.name == "model.norm.weight" else s for s in specs
    ]
    with pytest.raises(ValueError, match="'model.norm.weight'.*outside shape \\(100,\\)"):
        materialize(recipes, wrong, src)
    with pytest.raises(ValueError, match="'model.norm.weight' is built twice"):
        materialize([*recipes, recipes[-2]], specs, src)


def test_fp8_spec_errors() -> None:
    shape = get_model_shape("tiny")
    src = hf_tensors(shape, seed=4)
    recipes = vllm_recipes(shape, 0, 1, fp8=True)
    specs = vllm_tensor_specs(shape, 0, 1, fp8=True)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    no_scale = [s for s in specs if s.name != qkv + "_scale_inv"]
    with pytest.raises(ValueError, match=f"'{qkv}_scale_inv' has no destination spec"):
        materialize(recipes, no_scale, src)
    bad_scale = [
        dataclasses.replace(s, shape=(2, 2)) if s.name == qkv + "_scale_inv" else s for s in specs
    ]
    with pytest.raises(ValueError, match=f"'{qkv}_scale_inv'.*expected float32 \\(3, 2\\)"):
        materialize(recipes, bad_scale, src)
    bf16 = [dataclasses.replace(s, dtype="bfloat16") if s.name == qkv else s for s in specs]
    with pytest.raises(ValueError, match=f"FP8 recipe for '{qkv}' but its spec says dtype"):
        materialize(recipes, bf16, src)


def _r(*parts: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]) -> Recipe:
    return Recipe("t", tuple(Part(f"s{i}", s, d) for i, (s, d) in enumerate(parts)))


def test_check_coverage() -> None:
    # Exact cover of a 3-D stacked tensor by 2-D sources (unit dims dropped).
    ok = _r(
        (((0, 4), (0, 3)), ((0, 1), (0, 4), (0, 3))), (((0, 4), (0, 3)), ((1, 2), (0, 4), (0, 3)))
    )
    check_coverage(ok, (2, 4, 3))
    with pytest.raises(ValueError, match="'t': parts cover 24 of 48 elements"):
        check_coverage(ok, (2, 4, 6))
    with pytest.raises(ValueError, match="'s0'.*'s1'.*overlap"):
        check_coverage(_r((((0, 3),), ((0, 3),)), (((0, 3),), ((2, 5),))), (5,))
    # Overlap that does not start at the same row, found by the sweep.
    with pytest.raises(ValueError, match="overlap"):
        check_coverage(
            _r(
                (((0, 4), (0, 2)), ((0, 4), (0, 2))),
                (((0, 2), (0, 4)), ((1, 3), (2, 6))),
                (((0, 4), (0, 1)), ((3, 7), (1, 2))),
            ),
            (8, 6),
        )
    with pytest.raises(ValueError, match="maps source box .* of a different shape"):
        check_coverage(_r((((0, 2), (0, 3)), ((0, 3), (0, 2)))), (3, 2))
    with pytest.raises(ValueError, match="has 1 dims, tensor shape \\(3, 2\\) has 2"):
        check_coverage(_r((((0, 6),), ((0, 6),))), (3, 2))
    with pytest.raises(ValueError, match="empty or outside"):
        check_coverage(_r((((0, 0),), ((0, 0),))), (3,))
    with pytest.raises(ValueError, match="has no parts"):
        check_coverage(Recipe("t", ()), (3,))
    check_coverage(Recipe("t", ()), (0, 3))


@pytest.mark.parametrize("fp8", [False, True])
def test_apply_recipe_into_engine_tensors(fp8: bool) -> None:
    """An engine's loader path (write into its own tensors, a given quantizer) builds what the
    reference builds into new tensors, for dense and stacked-expert (MoE) recipes."""
    shape = get_model_shape("tiny-moe")
    g = torch.Generator().manual_seed(3)
    src = {
        n: torch.randn(s, generator=g).to(torch.bfloat16)
        for n, s in hf_parameter_shapes(shape).items()
    }
    recipes = vllm_recipes(shape, 1, 2, fp8=fp8)
    specs = vllm_tensor_specs(shape, 1, 2, fp8=fp8)
    want = materialize(recipes, specs, src)
    calls: list[tuple[int, ...]] = []

    def quantize(x: torch.Tensor, block: tuple[int, int], q: torch.Tensor, s: torch.Tensor) -> None:
        calls.append(tuple(x.shape))
        qq, ss = quantize_fp8_blockwise(x, block)
        q.copy_(qq)
        s.copy_(ss)

    out = {s.name: torch.full(s.shape, 7.0).to(getattr(torch, s.dtype)) for s in specs}
    for r in recipes:
        spec = next(s for s in specs if s.name == r.dest)
        got = apply_recipe(
            r, spec.shape, getattr(torch, spec.dtype), src, out=out, quantize=quantize
        )
        assert all(t.data_ptr() == out[n].data_ptr() for n, t in got.items())
    for name, t in want.items():
        assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
    if fp8:
        assert calls and all(len(c) == 2 for c in calls)  # one 2-D slice (expert) at a time
