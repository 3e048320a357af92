"""Generic recipe builders: shards (even, uneven, explicit), fusions, MoE stacks, FP8, specs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weight_transfer.planner.recipes import (
    TensorSpec,
    column_shard,
    concat_rows,
    engine_tensor_specs,
    even_bounds,
    fused_gate_up,
    fused_qkv,
    identity,
    moe_w2,
    moe_w2_fused,
    moe_w13,
    moe_w13_fused,
    qkv_head_ranges,
    recipe_shape,
    row_shard,
    scale_name,
    shard,
    split_bounds,
    with_fp8,
)
from weight_transfer.planner.reference import materialize
from weight_transfer.planner.types import Fp8BlockQuant, Part, Recipe


def _rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _build(recipe: Recipe, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    specs = engine_tensor_specs([recipe])
    return materialize([recipe], specs, sources)[recipe.dest]


def test_split_bounds_uneven_rule() -> None:
    assert split_bounds(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert split_bounds(8, 4) == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert split_bounds(3, 4) == ((0, 1), (1, 2), (2, 3), (3, 3))
    with pytest.raises(ValueError, match="w13: size 10 is not divisible by tensor-parallel size 4"):
        even_bounds(10, 4, what="w13")


@given(size=st.integers(1, 500), parts=st.integers(1, 16))
def test_split_bounds_tile(size: int, parts: int) -> None:
    bounds = split_bounds(size, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_identity() -> None:
    x = _rand(7, 5, seed=0)
    r = identity("d", "s", (7, 5))
    assert r.parts == (Part("s", ((0, 7), (0, 5)), ((0, 7), (0, 5))),)
    assert torch.equal(_build(r, {"s": x}), x)


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4, 7])
def test_uneven_column_and_row_shards(tp_size: int) -> None:
    """Uneven generic shards equal torch.tensor_split (numpy array_split rule)."""
    x = _rand(11, 13, seed=1)
    for rank in range(tp_size):
        col = _build(column_shard("d", "s", (11, 13), tp_rank=rank, tp_size=tp_size), {"s": x})
        row = _build(row_shard("d", "s", (11, 13), tp_rank=rank, tp_size=tp_size), {"s": x})
        assert torch.equal(col, torch.tensor_split(x, tp_size, dim=0)[rank])
        assert torch.equal(row, torch.tensor_split(x, tp_size, dim=1)[rank])


def test_explicit_bounds_and_their_errors() -> None:
    x = _rand(10, 4, seed=2)
    bounds = [(0, 2), (2, 9), (9, 10)]
    r = column_shard("d", "s", (10, 4), tp_rank=1, tp_size=3, bounds=bounds)
    assert torch.equal(_build(r, {"s": x}), x[2:9])
    with pytest.raises(ValueError, match="2 bounds given for tp_size 3"):
        column_shard("d", "s", (10, 4), tp_rank=1, tp_size=3, bounds=[(0, 5), (5, 10)])
    with pytest.raises(ValueError, match="do not tile"):
        column_shard("d", "s", (10, 4), tp_rank=1, tp_size=3, bounds=[(0, 2), (3, 9), (9, 10)])
    with pytest.raises(ValueError, match="do not tile"):
        column_shard("d", "s", (10, 4), tp_rank=1, tp_size=3, bounds=[(0, 2), (2, 9), (9, 11)])
    with pytest.raises(ValueError, match="rank 3 of 4 would hold an empty shard"):
        column_shard("d", "s", (3, 4), tp_rank=3, tp_size=4)
    with pytest.raises(ValueError, match="tp_rank must be in"):
        row_shard("d", "s", (3, 4), tp_rank=4, tp_size=4)
    with pytest.raises(ValueError, match="dim 2 out of range"):
        shard("d", "s", (3, 4), dim=2, tp_rank=0, tp_size=1)


def test_shard_of_3d_tensor_along_last_dim() -> None:
    x = _rand(3, 4, 10, seed=3)
    r = shard("d", "s", (3, 4, 10), dim=2, tp_rank=1, tp_size=2)
    assert torch.equal(_build(r, {"s": x}), x[:, :, 5:])


def test_qkv_head_ranges() -> None:
    # tp <= kv heads: both split.
    assert qkv_head_ranges(8, 4, 1, 2) == ((4, 8), (2, 4))
    # tp > kv heads: kv head r // (tp // kv).
    assert [qkv_head_ranges(8, 2, r, 8)[1] for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [qkv_head_ranges(8, 2, r, 8)[0] for r in range(8)] == [(r, r + 1) for r in range(8)]
    # MHA at tp == heads.
    assert qkv_head_ranges(4, 4, 3, 4) == ((3, 4), (3, 4))
    with pytest.raises(ValueError, match=r"num_heads=8, num_kv_heads=2, tp_size=3.*num_heads"):
        qkv_head_ranges(8, 2, 0, 3)
    with pytest.raises(
        ValueError, match=r"replicated evenly \(num_heads=12, num_kv_heads=4, tp_size=6\)"
    ):
        qkv_head_ranges(12, 4, 0, 6)
    with pytest.raises(ValueError, match=r"kv heads do not split.*num_kv_heads=3, tp_size=2"):
        qkv_head_ranges(12, 3, 0, 2)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_fused_qkv_weight_and_bias(tp_size: int) -> None:
    heads, kv_heads, hd, hidden = 8, 2, 4, 6
    q = _rand(heads * hd, hidden, seed=4)
    k = _rand(kv_heads * hd, hidden, seed=5)
    v = _rand(kv_heads * hd, hidden, seed=6)
    qb, kb, vb = (
        _rand(heads * hd, seed=7),
        _rand(kv_heads * hd, seed=8),
        _rand(kv_heads * hd, seed=9),
    )
    src = {"q": q, "k": k, "v": v, "qb": qb, "kb": kb, "vb": vb}
    for rank in range(tp_size):
        kv_chunks = min(tp_size, kv_heads)
        kv_idx = rank * kv_chunks // tp_size
        w = fused_qkv(
            "qkv",
            "q",
            "k",
            "v",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hd,
            trailing=(hidden,),
            tp_rank=rank,
            tp_size=tp_size,
        )
        b = fused_qkv(
            "qkvb",
            "qb",
            "kb",
            "vb",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hd,
            trailing=(),
            tp_rank=rank,
            tp_size=tp_size,
        )
        for recipe, (qq, kk, vv) in ((w, (q, k, v)), (b, (qb, kb, vb))):
            want = torch.cat(
                [qq.chunk(tp_size)[rank], kk.chunk(kv_chunks)[kv_idx], vv.chunk(kv_chunks)[kv_idx]]
            )
            assert torch.equal(_build(recipe, src), want)


def test_fused_gate_up_uneven() -> None:
    gate, up = _rand(9, 4, seed=10), _rand(9, 4, seed=11)
    for rank in range(2):
        r = fused_gate_up("gu", "g", "u", shape=(9, 4), tp_rank=rank, tp_size=2)
        want = torch.cat([gate.tensor_split(2)[rank], up.tensor_split(2)[rank]])
        assert torch.equal(_build(r, {"g": gate, "u": up}), want)


def test_concat_rows_errors() -> None:
    with pytest.raises(ValueError, match="'b' has shape \\(4, 3\\), trailing dims differ"):
        concat_rows("d", [("a", (4, 2), (0, 4)), ("b", (4, 3), (0, 4))])
    with pytest.raises(ValueError, match="rows \\[2, 5\\) of 'a'"):
        concat_rows("d", [("a", (4, 2), (2, 5))])
    with pytest.raises(ValueError, match="nothing to concatenate"):
        concat_rows("d", [])


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_moe_stacks_per_expert_and_fused_agree(tp_size: int) -> None:
    num_experts, inter, hidden = 3, 10, 6
    gates = [_rand(inter, hidden, seed=20 + e) for e in range(num_experts)]
    ups = [_rand(inter, hidden, seed=30 + e) for e in range(num_experts)]
    downs = [_rand(hidden, inter, seed=40 + e) for e in range(num_experts)]
    src = {f"g{e}": gates[e] for e in range(num_experts)}
    src |= {f"u{e}": ups[e] for e in range(num_experts)}
    src |= {f"d{e}": downs[e] for e in range(num_experts)}
    src["gate_up"] = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
    src["down"] = torch.stack(downs)
    names = range(num_experts)
    for rank in range(tp_size):
        kw = {
            "intermediate_size": inter,
            "hidden_size": hidden,
            "tp_rank": rank,
            "tp_size": tp_size,
        }
        want13 = torch.stack(
            [
                torch.cat([g.tensor_split(tp_size)[rank], u.tensor_split(tp_size)[rank]])
                for g, u in zip(gates, ups, strict=True)
            ]
        )
        want2 = torch.stack([d.tensor_split(tp_size, dim=1)[rank] for d in downs])
        w13 = moe_w13("w13", [f"g{e}" for e in names], [f"u{e}" for e in names], **kw)  # type: ignore[arg-type]
        w2 = moe_w2("w2", [f"d{e}" for e in names], **kw)  # type: ignore[arg-type]
        w13f = moe_w13_fused("w13", "gate_up", num_experts=num_experts, **kw)  # type: ignore[arg-type]
        w2f = moe_w2_fused("w2", "down", num_experts=num_experts, **kw)  # type: ignore[arg-type]
        assert torch.equal(_build(w13, src), want13)
        assert torch.equal(_build(w13f, src), want13)
        assert torch.equal(_build(w2, src), want2)
        assert torch.equal(_build(w2f, src), want2)
        # Every builder declares the global shape of what it reads (the planner refuses others).
        for r in (w13, w2, w13f, w2f):
            declared = {spec.name: spec.shape for spec in r.sources}
            assert {p.source for p in r.parts} == set(declared), r.dest
            assert all(declared[n] == tuple(src[n].shape) for n in declared), r.dest
    with pytest.raises(ValueError, match="as many gate as up"):
        moe_w13(
            "w13", ["g0"], [], intermediate_size=inter, hidden_size=hidden, tp_rank=0, tp_size=1
        )


def test_with_fp8_and_scale_name() -> None:
    r = with_fp8(identity("model.layers.0.mlp.experts.w13_weight", "s", (4, 8)), block=(64, 32))
    assert r.quant == Fp8BlockQuant(
        scale_dest="model.layers.0.mlp.experts.w13_weight_scale_inv", block=(64, 32)
    )
    assert scale_name("x.qkv_proj.weight") == "x.qkv_proj.weight_scale_inv"


def test_engine_tensor_specs_scales_use_the_fused_sharded_shape() -> None:
    # A w13 shard [E=4, 2 * 192, 256]: 384 rows -> 3 row blocks; 256 cols -> 2 col blocks.
    w13 = with_fp8(
        moe_w13(
            "w13_weight",
            [f"g{e}" for e in range(4)],
            [f"u{e}" for e in range(4)],
            intermediate_size=384,
            hidden_size=256,
            tp_rank=1,
            tp_size=2,
        )
    )
    # A gate_up shard of intermediate 704 at tp 4: 2 * 176 = 352 rows -> 3 blocks, not 2 * 2.
    gu = with_fp8(
        fused_gate_up("gate_up_proj.weight", "g", "u", shape=(704, 100), tp_rank=0, tp_size=4)
    )
    norm = identity("norm.weight", "n", (100,))
    specs = engine_tensor_specs(
        [w13, gu, norm], param_dtype="float16", dtypes={"norm.weight": "float32"}
    )
    assert specs == (
        TensorSpec("w13_weight", (4, 384, 256), "float8_e4m3fn"),
        TensorSpec("w13_weight_scale_inv", (4, 3, 2), "float32"),
        TensorSpec("gate_up_proj.weight", (352, 100), "float8_e4m3fn"),
        TensorSpec("gate_up_proj.weight_scale_inv", (3, 1), "float32"),
        TensorSpec("norm.weight", (100,), "float32"),
    )
    with pytest.raises(ValueError, match="'norm.weight' is produced twice"):
        engine_tensor_specs([norm, norm])
    with pytest.raises(ValueError, match="dtype 'bf16'"):
        engine_tensor_specs([norm], param_dtype="bf16")


def test_recipe_shape_rejects_gaps_and_overlaps() -> None:
    gap = Recipe(
        "d",
        (
            Part("a", ((0, 2), (0, 4)), ((0, 2), (0, 4))),
            Part("b", ((0, 2), (0, 4)), ((3, 5), (0, 4))),
        ),
    )
    with pytest.raises(ValueError, match="'d': parts cover 16 of 20 elements"):
        recipe_shape(gap)
    overlap = Recipe(
        "d",
        (
            Part("a", ((0, 3), (0, 4)), ((0, 3), (0, 4))),
            Part("b", ((0, 2), (0, 4)), ((2, 4), (0, 4))),
        ),
    )
    with pytest.raises(ValueError, match="'a'.*'b'.*overlap"):
        recipe_shape(overlap)
    with pytest.raises(ValueError, match="no parts"):
        recipe_shape(Recipe("d", ()))
    mixed = Recipe(
        "d", (Part("a", ((0, 2),), ((0, 2),)), Part("b", ((0, 2), (0, 1)), ((2, 4), (0, 1))))
    )
    with pytest.raises(ValueError, match="mixes dest boxes of ranks"):
        recipe_shape(mixed)
