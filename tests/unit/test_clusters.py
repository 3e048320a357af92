"""Cluster presets: FSDP2 chunking, expert meshes, MLA recipes and model sizes."""

from __future__ import annotations

import pytest
import torch

from weight_transfer.backends.base import ConfigurationError
from weight_transfer.planner.presets.clusters import (
    PRESETS,
    chunk_bounds,
    cluster_manifests,
    get_preset,
    get_shape,
    with_overrides,
)
from weight_transfer.planner.presets.deepseek import (
    MLA_SHAPES,
    local_experts,
    mla_parameter_shapes,
    mla_recipes,
)
from weight_transfer.planner.recipes import engine_tensor_specs
from weight_transfer.planner.types import box_shape, numel


@pytest.mark.parametrize("size,k", [(10, 4), (5, 4), (3, 8), (128, 8), (0, 2)])
def test_chunk_bounds_match_torch_chunk(size: int, k: int) -> None:
    got = chunk_bounds(size, k)
    assert len(got) == k
    pieces = torch.chunk(torch.arange(size), k) if size else ()
    # torch.chunk may return fewer than k pieces; the shards past them are checked below.
    for (a, b), piece in zip(got[: len(pieces)], pieces, strict=True):
        assert torch.equal(torch.arange(size)[a:b], piece)
    assert all(a == b for a, b in got[len(pieces) :])  # FSDP2's padded, empty trailing shards


def test_mini_manifests_cover_every_tensor_once_per_mesh() -> None:
    preset = get_preset("kimi-k2-mini")
    sources, dests = cluster_manifests(preset)
    assert len(sources) == 32 and len(dests) == 16
    cover: dict[tuple[str, tuple[int, ...]], int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for m in sources:
        for t in m.tensors:
            assert m.rank in t.mesh
            shapes[t.name] = t.shape
            assert t.local_box is not None
            cover[(t.name, t.mesh)] = cover.get((t.name, t.mesh), 0) + numel(box_shape(t.local_box))
    for (name, _mesh), n in cover.items():
        assert n == numel(shapes[name]), name
    # Experts live on exactly one mesh of 8; dense tensors on 4 disjoint replica meshes.
    meshes: dict[str, set[tuple[int, ...]]] = {}
    for name, mesh in cover:
        meshes.setdefault(name, set()).add(mesh)
    assert len(meshes["model.layers.1.mlp.experts.5.up_proj.weight"]) == 1
    assert len(meshes["model.layers.1.self_attn.kv_b_proj.weight"]) == 4
    assert set(shapes) == set(mla_parameter_shapes(get_shape("kimi-k2-mini")))  # type: ignore[arg-type]


def test_mla_recipe_shapes() -> None:
    s = MLA_SHAPES["kimi-k2"]
    specs = {
        t.name: t
        for t in engine_tensor_specs(mla_recipes(s, tp_rank=1, tp_size=8, ep_rank=3, ep_size=32))
    }
    p = "model.layers.5."
    assert specs[p + "self_attn.fused_qkv_a_proj.weight"].shape == (1536 + 512 + 64, 7168)
    assert specs[p + "self_attn.q_b_proj.weight"].shape == (8 * 192, 1536)
    assert specs[p + "self_attn.kv_b_proj.weight"].shape == (8 * 256, 512)
    assert specs[p + "self_attn.o_proj.weight"].shape == (7168, 8 * 128)
    assert specs[p + "mlp.experts.routed_experts.w13_weight"].shape == (12, 4096, 7168)
    assert specs[p + "mlp.experts.routed_experts.w13_weight_scale_inv"].shape == (12, 32, 56)
    assert specs[p + "mlp.experts.routed_experts.w2_weight"].dtype == "float8_e4m3fn"
    assert "model.layers.0.mlp.gate_up_proj.weight" in specs  # first dense layer
    assert specs[p + "mlp.gate.e_score_correction_bias"].shape == (384,)
    assert local_experts(384, 3, 32) == (36, 48)
    with pytest.raises(ConfigurationError, match="do not divide"):
        local_experts(384, 0, 7)


def test_model_sizes_match_published_parameter_counts() -> None:
    kimi = sum(numel(d) for d in mla_parameter_shapes(MLA_SHAPES["kimi-k2"]).values())
    dsv3 = sum(numel(d) for d in mla_parameter_shapes(MLA_SHAPES["deepseek-v3"]).values())
    assert 1.02e12 < kimi < 1.04e12  # 1.04T with the (unlisted) MTP layer
    assert 0.66e12 < dsv3 < 0.672e12  # 671B with its MTP layer (~11.5B)


def test_overrides_and_bad_layouts() -> None:
    p = with_overrides(PRESETS["kimi-k2"], **{"engine.num_replicas": 8, "rates.nic_gb_per_s": 25.0})
    assert p.engine.num_gpus == 256 and p.rates.nic_gb_per_s == 25.0
    with pytest.raises(ValueError, match="override"):
        with_overrides(PRESETS["kimi-k2"], **{"network.x": 1})
    with pytest.raises(ValueError, match="dense_shard_size"):
        with_overrides(PRESETS["kimi-k2"], **{"trainer.dense_shard_size": 7})
    with pytest.raises(ConfigurationError, match="unknown cluster preset"):
        get_preset("nope")
    too_many = with_overrides(PRESETS["kimi-k2-mini"], **{"trainer.expert_shard_size": 1})
    with pytest.raises(ConfigurationError, match="expert meshes"):
        cluster_manifests(too_many)


def test_h200x2_presets_share_one_host_and_plan() -> None:
    from weight_transfer.planner.plan import PlannerConfig, plan
    from weight_transfer.planner.presets.clusters import H200X2_RATES

    p = get_preset("h200x2-llama8b-colocated")
    assert p.rates == H200X2_RATES
    sources, dests = cluster_manifests(p)
    assert {m.host for m in sources} == {d.host for d in dests} == {"node0"}
    s = plan(sources, dests, PlannerConfig(memory_budget_bytes=4 << 30))
    assert s.num_ranks == 2 and len(s.engines) == 2
    # FSDP2 over 2 GPUs into tp=2: both trainer ranks send half of the bytes.
    assert s.bytes_per_rank[0] == s.bytes_per_rank[1] == sum(s.bytes_per_engine) // 2
    split = get_preset("h200x2-llama8b-fp8")
    assert split.engine.fp8 and split.trainer.num_gpus == 1 and split.engine.num_gpus == 1
