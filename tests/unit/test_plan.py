"""Planner: shard-to-shard decomposition, FP8 gathers, balance, ordering, determinism, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from weight_transfer.backends.base import PlanMismatchError
from weight_transfer.planner.plan import (
    PlannerConfig,
    dest_runs,
    is_contiguous_box,
    plan,
    schedule_from_json,
    schedule_to_json,
)
from weight_transfer.planner.presets.models import ModelShape, get_model_shape, hf_parameter_shapes
from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
from weight_transfer.planner.recipes import split_bounds
from weight_transfer.planner.reference import materialize
from weight_transfer.planner.types import (
    DestManifest,
    DestRegion,
    DestTensor,
    Part,
    QuantWrite,
    SliceWrite,
    SourceManifest,
    SourceTensor,
    WriteRun,
    box_shape,
    dtype_size,
    numel,
)


def fsdp_sources(
    shapes: dict[str, tuple[int, ...]], world: int, dtype: str = "bfloat16"
) -> list[SourceManifest]:
    """Manifests of an FSDP2-style dim-0 sharding (torch.chunk sizes: uneven, maybe empty)."""
    out = []
    for r in range(world):
        tensors = []
        for name, shape in sorted(shapes.items()):
            chunk = -(-shape[0] // world)
            a, b = min(shape[0], r * chunk), min(shape[0], (r + 1) * chunk)
            box = ((a, b),) + tuple((0, n) for n in shape[1:])
            tensors.append(SourceTensor(name, shape, dtype, box, tuple(range(world)), "cpu"))
        out.append(SourceManifest(rank=r, world_size=world, host="h", tensors=tuple(tensors)))
    return out


def engine_manifest(engine: str, recipes, specs) -> DestManifest:
    """Pack an engine's tensors back to back in one region, version word in a second."""
    tensors, off = [], 0
    for s in specs:
        tensors.append(DestTensor(s.name, s.shape, s.dtype, 0, off))
        off += numel(s.shape) * dtype_size(s.dtype)
    return DestManifest(
        engine=engine,
        host="h",
        regions=(DestRegion(0, off, b"r0"), DestRegion(1, 8, b"v")),
        tensors=tuple(tensors),
        recipes=tuple(recipes),
        version_region=1,
    )


def tiny_setup(world=3, tp=2, fp8=False, dtype="bfloat16"):
    shape = get_model_shape("tiny")
    sources = fsdp_sources(hf_parameter_shapes(shape), world, dtype)
    dests = [
        engine_manifest(
            f"engine{e}",
            vllm_recipes(shape, e, tp, fp8=fp8),
            vllm_tensor_specs(shape, e, tp, fp8=fp8),
        )
        for e in range(tp)
    ]
    return shape, sources, dests


def simulate_schedule(
    schedule, sources, dests, full: dict[str, torch.Tensor]
) -> dict[str, bytearray]:
    """Execute a schedule on byte arrays (an executor independent of the runtime)."""
    from weight_transfer.planner.fp8 import quantize_fp8_blockwise

    mems = {d.engine: bytearray(d.regions[0].nbytes) for d in dests}
    written = {d.engine: bytearray(d.regions[0].nbytes) for d in dests}

    def put(engine, runs, data: bytes):
        pos = 0
        for r in runs:
            assert r.region == 0
            mems[engine][r.offset_bytes : r.offset_bytes + r.nbytes] = data[pos : pos + r.nbytes]
            for i in range(r.offset_bytes, r.offset_bytes + r.nbytes):
                assert not written[engine][i], f"byte {i} of {engine} written twice"
                written[engine][i] = 1
            pos += r.nbytes
        assert pos == len(data)

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    for rs in schedule.ranks:
        for task in rs.tasks:
            for w in task.writes:
                if isinstance(w, SliceWrite):
                    src = full[w.source][tuple(slice(a, b) for a, b in w.source_box)]
                    put(w.engine, w.runs, raw(src.to(getattr(torch, w.dtype))))
                else:
                    assert isinstance(w, QuantWrite)
                    hp = torch.empty(box_shape(w.dest_box), dtype=torch.float32)
                    o = [a for a, _ in w.dest_box]
                    for p in w.parts:
                        sl = tuple(
                            slice(a - oo, b - oo) for (a, b), oo in zip(p.dest_box, o, strict=True)
                        )
                        hp[sl] = (
                            full[p.source][tuple(slice(a, b) for a, b in p.source_box)]
                            .reshape(box_shape(p.dest_box))
                            .float()
                        )
                    q, s = quantize_fp8_blockwise(hp, w.block)
                    put(w.engine, w.weight_runs, raw(q))
                    put(w.engine, w.scale_runs, raw(s))
    for d in dests:
        assert all(written[d.engine]), (
            f"{d.engine}: {written[d.engine].count(0)} bytes never written"
        )
    return mems


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("world,tp", [(3, 2), (1, 1), (4, 8), (5, 4)])
def test_schedule_reproduces_reference_layout(world, tp, fp8):
    shape, sources, dests = tiny_setup(world, tp, fp8)
    schedule = plan(sources, dests)
    assert_reference_layout(schedule, sources, dests, shape, tp, fp8, seed=7)


def assert_reference_layout(schedule, sources, dests, shape, tp, fp8, *, seed):
    """Run `schedule` with the test's own executor (`simulate_schedule`) on seeded random
    weights and compare every engine tensor, byte for byte, with the reference layout
    (`materialize`, whose quantizer sees each whole tensor)."""
    g = torch.Generator().manual_seed(seed)
    full = {
        n: torch.randn(s, generator=g).to(torch.bfloat16)
        for n, s in hf_parameter_shapes(shape).items()
    }
    mems = simulate_schedule(schedule, sources, dests, full)
    for e, d in enumerate(dests):
        specs = vllm_tensor_specs(shape, e, tp, fp8=fp8)
        expect = materialize(vllm_recipes(shape, e, tp, fp8=fp8), specs, full)
        for t in d.tensors:
            n = numel(t.shape) * dtype_size(t.dtype)
            got = torch.frombuffer(
                bytearray(mems[d.engine][t.offset_bytes : t.offset_bytes + n]), dtype=torch.uint8
            )
            want = expect[t.name].contiguous().view(-1).view(torch.uint8)
            assert torch.equal(got, want), f"{d.engine}:{t.name}"


def test_bf16_plan_is_shard_to_shard_and_balanced():
    _, sources, dests = tiny_setup(3, 2)
    s = plan(sources, dests)
    assert all(t.kind == "direct" and not t.gather for r in s.ranks for t in r.tasks)
    # Every rank sends; bytes balanced within 25 % (each byte is sent by its owner).
    assert min(s.bytes_per_rank) > 0
    assert max(s.bytes_per_rank) <= 1.25 * min(s.bytes_per_rank)
    assert sum(s.bytes_per_rank) == sum(s.bytes_per_engine)
    # Same dtype, full rows: most writes go straight from the shard, no staging.
    writes = [w for r in s.ranks for t in r.tasks for w in t.writes]
    assert sum(w.zero_copy for w in writes) >= len(writes) // 2


def test_cast_disables_zero_copy():
    _, sources, dests = tiny_setup(3, 2, dtype="float32")
    s = plan(sources, dests)
    assert not any(w.zero_copy for r in s.ranks for t in r.tasks for w in t.writes)


def test_fp8_gathers_ordered_identically_on_every_mesh_rank():
    _, sources, dests = tiny_setup(3, 2, fp8=True)
    s = plan(sources, dests)
    seqs = [[(t.task_id, t.gather) for t in r.tasks if t.kind == "gather"] for r in s.ranks]
    assert seqs[0] and seqs[0] == seqs[1] == seqs[2]
    # qkv of both engine ranks share one gather of q, k, v.
    qkv = [g for _, g in seqs[0] if any("q_proj" in n for n in g)]
    assert qkv and all(len(g) == 3 for g in qkv)
    for r in s.ranks:
        for t in r.tasks:
            if t.kind == "gather":
                assert t.scratch_bytes > 0


def test_deterministic_json_round_trip():
    _, sources, dests = tiny_setup(3, 2, fp8=True)
    a = schedule_to_json(plan(sources, dests))
    b = schedule_to_json(plan(list(reversed(sources)), list(reversed(dests))))
    assert a == b
    assert schedule_to_json(schedule_from_json(a)) == a
    json.loads(a)


def test_mesh_groups_for_disjoint_meshes():
    # Two expert meshes {0,1} and {2,3}: gathers in parallel (one group); a third mesh
    # overlapping both ({1,2}) needs its own group.
    def st(name, mesh, rank):
        i = mesh.index(rank)
        return SourceTensor(
            name, (256, 128), "bfloat16", ((i * 128, i * 128 + 128), (0, 128)), mesh, "cpu"
        )

    layout = {"a": (0, 1), "b": (2, 3), "c": (1, 2)}
    sources = []
    for r in range(4):
        ts = tuple(st(n, m, r) for n, m in sorted(layout.items()) if r in m)
        sources.append(SourceManifest(rank=r, world_size=4, host="h", tensors=ts))
    recipes, specs = [], []
    from weight_transfer.planner.recipes import TensorSpec, identity, with_fp8

    for n in layout:
        recipes.append(with_fp8(identity(n, n, (256, 128))))
        specs += [
            TensorSpec(n, (256, 128), "float8_e4m3fn"),
            TensorSpec(n + "_scale_inv", (2, 1), "float32"),
        ]
    # Gathered on purpose (each 128-row shard is a whole block row: banded otherwise).
    cfg = PlannerConfig(quantize_in_shards=False)
    s = plan(sources, [engine_manifest("e", recipes, specs)], cfg)
    groups = {t.gather: t.mesh_group for r in s.ranks for t in r.tasks if t.kind == "gather"}
    assert groups[("a",)] == groups[("b",)] != groups[("c",)]
    assert s.num_mesh_groups == 2
    for r in s.ranks:
        assert [t.mesh_group for t in r.tasks] == sorted(t.mesh_group for t in r.tasks)


def test_large_direct_writes_are_split():
    _, sources, dests = tiny_setup(1, 1)
    cfg = PlannerConfig(
        max_write_bytes=16 << 10, memory_budget_bytes=1 << 20, task_target_bytes=64 << 10
    )
    s = plan(sources, dests, cfg)
    for r in s.ranks:
        for t in r.tasks:
            assert t.staging_bytes <= cfg.memory_budget_bytes // 2
            for w in t.writes:
                assert w.nbytes <= 16 << 10 or box_shape(w.source_box)[0] == 1


def test_dest_runs_and_contiguity():
    assert dest_runs((4, 6), ((1, 3), (0, 6)), 2, 100, 0) == (WriteRun(0, 100 + 12, 24),)
    assert dest_runs((4, 6), ((1, 3), (2, 4)), 2, 0, 0) == (WriteRun(0, 16, 4), WriteRun(0, 28, 4))
    assert dest_runs((2, 3, 4), ((1, 2), (0, 3), (0, 4)), 1, 0, 5) == (WriteRun(5, 12, 12),)
    assert is_contiguous_box((4, 6), ((1, 3), (0, 6)))
    assert is_contiguous_box((4, 6), ((1, 2), (2, 4)))
    assert not is_contiguous_box((4, 6), ((1, 3), (2, 4)))


def test_split_bounds_uneven():
    assert split_bounds(10, 3) == ((0, 4), (4, 7), (7, 10))


# -- bad input: every problem listed, named -----------------------------------------------------


def problems_of(sources, dests) -> list[str]:
    with pytest.raises(PlanMismatchError) as info:
        plan(sources, dests)
    return info.value.problems


def test_missing_and_extra_tensors_are_named():
    _, sources, dests = tiny_setup(3, 2)
    drop = "model.layers.1.mlp.up_proj.weight"
    sources = [
        SourceManifest(m.rank, m.world_size, m.host, tuple(t for t in m.tensors if t.name != drop))
        for m in sources
    ]
    extra = SourceTensor("model.extra.weight", (4, 4), "bfloat16", ((0, 4), (0, 4)), (0,), "cpu")
    sources[0] = SourceManifest(0, 3, "h", sources[0].tensors + (extra,))
    probs = problems_of(sources, dests)
    assert any(drop in p and "no trainer rank" in p for p in probs)
    assert any("model.extra.weight" in p and "extra" in p for p in probs)


def test_shape_and_dtype_mismatch_named():
    _, sources, dests = tiny_setup(3, 2)
    bad = []
    for m in sources:
        ts = []
        for t in m.tensors:
            if t.name == "model.layers.0.self_attn.o_proj.weight":
                t = SourceTensor(t.name, t.shape, "int32", t.local_box, t.mesh, t.device)
            if t.name == "model.layers.0.mlp.down_proj.weight":
                t = SourceTensor(
                    t.name, (t.shape[0], 100), t.dtype, (t.local_box[0], (0, 100)), t.mesh, t.device
                )
            ts.append(t)
        bad.append(SourceManifest(m.rank, m.world_size, m.host, tuple(ts)))
    probs = problems_of(bad, dests)
    assert any("o_proj" in p and "int32" in p for p in probs)
    assert (
        "trainer tensor 'model.layers.0.mlp.down_proj.weight' is shape (256, 100), but engine "
        "'engine0' reads it for 'model.layers.0.mlp.down_proj.weight' as shape (256, 704) "
        "(and 1 more engine recipe(s))"
    ) in probs


def test_duplicate_names_and_engines():
    _, sources, dests = tiny_setup(2, 2)
    t0 = sources[0].tensors[0]
    sources[0] = SourceManifest(0, 2, "h", sources[0].tensors + (t0,))
    probs = problems_of(sources, dests + [dests[0]])
    assert any("duplicate tensor name" in p and t0.name in p for p in probs)
    assert any("engine0" in p and "more than once" in p for p in probs)


def test_recipe_gap_and_overlap():
    _, sources, dests = tiny_setup(1, 1)
    d = dests[0]
    rc = next(r for r in d.recipes if r.dest.endswith("o_proj.weight"))
    p = rc.parts[0]
    half = Part(p.source, ((0, 128), p.source_box[1]), ((0, 128), p.dest_box[1]))
    gap = dataclasses.replace(rc, parts=(half,))
    over = dataclasses.replace(rc, parts=(p, half))
    for bad_rc, word in ((gap, "cover"), (over, "cover")):
        recipes = tuple(bad_rc if r.dest == rc.dest else r for r in d.recipes)
        nd = DestManifest(d.engine, d.host, d.regions, d.tensors, recipes, d.version_region)
        probs = problems_of(sources, [nd])
        assert any(rc.dest in q and word in q for q in probs), probs


def test_engine_tensor_without_recipe_and_fp8_without_transform():
    _, sources, dests = tiny_setup(1, 1, fp8=True)
    d = dests[0]
    no_quant = tuple(dataclasses.replace(r, quant=None) for r in d.recipes)
    nd = DestManifest(d.engine, d.host, d.regions, d.tensors, no_quant, d.version_region)
    probs = problems_of(sources, [nd])
    assert any("no FP8 transform" in p for p in probs)
    assert any("_scale_inv" in p and "no recipe" in p for p in probs)


def test_missing_trainer_rank():
    _, sources, dests = tiny_setup(3, 2)
    probs = problems_of(sources[:2] + [SourceManifest(3, 3, "h", sources[2].tensors)], dests)
    assert any("one source manifest per trainer rank" in p for p in probs)


def test_budget_too_small_for_gather():
    _, sources, dests = tiny_setup(3, 2, fp8=True)
    with pytest.raises(PlanMismatchError, match="memory_budget_bytes"):
        plan(sources, dests, PlannerConfig(memory_budget_bytes=64 << 10, max_write_bytes=16 << 10))


# -- sources checked against the shapes recipes declare (issue 23) ------------------------------


def qwen3_shape(intermediate_size: int, tie: bool = False):
    from weight_transfer.planner.presets.models import ModelShape

    return ModelShape(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=intermediate_size,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        qk_norm=True,
        tie_word_embeddings=tie,
    )


def engines_for(shape, tp: int, **kw) -> list[DestManifest]:
    return [
        engine_manifest(
            f"engine{e}", vllm_recipes(shape, e, tp, **kw), vllm_tensor_specs(shape, e, tp, **kw)
        )
        for e in range(tp)
    ]


@pytest.mark.parametrize("trainer_inter", [896, 800])
def test_trainer_mlp_of_another_width_is_refused_not_truncated(trainer_inter):
    """The issue's case: a Qwen3 trainer with intermediate_size=896 against engines built for
    864 used to plan (every box the engine reads lies inside the larger tensor) and send the
    first 864 rows. Every mismatched tensor is listed once, naming both shapes."""
    sources = fsdp_sources(hf_parameter_shapes(qwen3_shape(trainer_inter)), 3)
    probs = problems_of(sources, engines_for(qwen3_shape(864), 2))
    want = []
    for i in range(2):
        p = f"model.layers.{i}.mlp."
        for src, dest, have, expect in (
            ("down_proj", "down_proj", (256, trainer_inter), (256, 864)),
            ("gate_proj", "gate_up_proj", (trainer_inter, 256), (864, 256)),
            ("up_proj", "gate_up_proj", (trainer_inter, 256), (864, 256)),
        ):
            want.append(
                f"trainer tensor '{p}{src}.weight' is shape {have}, but engine 'engine0' reads "
                f"it for '{p}{dest}.weight' as shape {expect} (and 1 more engine recipe(s))"
            )
    assert probs == sorted(want)


def test_padded_trainer_vocabulary_needs_the_option_and_is_never_sent():
    shape = qwen3_shape(864)
    shapes = hf_parameter_shapes(shape)
    padded = dict(shapes)
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        padded[n] = (1024, 256)  # a trainer's vocabulary padded to a multiple of 128
    sources = fsdp_sources(padded, 3)
    dests = engines_for(shape, 2)
    probs = problems_of(sources, dests)
    assert len(probs) == 2 and all(
        "is shape (1024, 256)" in p
        and "as shape (1000, 256)" in p
        and p.endswith("set PlannerConfig.allow_source_padding")
        for p in probs
    ), probs
    schedule = plan(sources, dests, PlannerConfig(allow_source_padding=True))
    g = torch.Generator().manual_seed(8)
    full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in padded.items()}
    mems = simulate_schedule(schedule, sources, dests, full)
    unpadded = {n: t[: shapes[n][0]] for n, t in full.items()}
    for e, d in enumerate(dests):
        expect = materialize(vllm_recipes(shape, e, 2), vllm_tensor_specs(shape, e, 2), unpadded)
        for t in d.tensors:
            n = numel(t.shape) * dtype_size(t.dtype)
            got = torch.frombuffer(
                bytearray(mems[d.engine][t.offset_bytes : t.offset_bytes + n]), dtype=torch.uint8
            )
            assert torch.equal(got, expect[t.name].contiguous().view(-1).view(torch.uint8))
    # Padding rows are never read: no write touches rows >= 1000 of the trainer's vocabulary.
    for r in schedule.ranks:
        for t in r.tasks:
            for w in t.writes:
                if w.source in ("model.embed_tokens.weight", "lm_head.weight"):
                    assert w.source_box[0][1] <= 1000


def test_padding_is_accepted_only_along_the_padded_dimension():
    shape = qwen3_shape(864)
    shapes = dict(hf_parameter_shapes(shape))
    shapes["model.embed_tokens.weight"] = (1000, 320)  # wider rows: not padding
    shapes["model.layers.0.mlp.gate_proj.weight"] = (896, 256)  # not marked as paddable
    probs = []
    with pytest.raises(PlanMismatchError) as info:
        plan(
            fsdp_sources(shapes, 2), engines_for(shape, 2), PlannerConfig(allow_source_padding=True)
        )
    probs = info.value.problems
    assert len(probs) == 2, probs
    assert any("'model.embed_tokens.weight' is shape (1000, 320)" in p for p in probs)
    assert any("'model.layers.0.mlp.gate_proj.weight' is shape (896, 256)" in p for p in probs)
    assert not any("allow_source_padding" in p for p in probs)


def test_recipe_without_declared_sources_and_exact_dtype():
    from weight_transfer.planner.types import SourceSpec

    _, sources, dests = tiny_setup(1, 1)
    d = dests[0]
    bare = tuple(
        dataclasses.replace(r, sources=()) if r.dest == "model.norm.weight" else r
        for r in d.recipes
    )
    probs = problems_of(sources, [dataclasses.replace(d, recipes=bare)])
    assert probs == [
        "engine 'engine0': recipe for 'model.norm.weight' reads trainer tensor "
        "'model.norm.weight' but does not declare its shape (Recipe.sources; the builders in "
        "planner.recipes fill it)"
    ]
    exact = tuple(
        dataclasses.replace(r, sources=(SourceSpec("model.norm.weight", (256,), "float32"),))
        if r.dest == "model.norm.weight"
        else r
        for r in d.recipes
    )
    probs = problems_of(sources, [dataclasses.replace(d, recipes=exact)])
    assert probs == [
        "trainer tensor 'model.norm.weight' is dtype bfloat16, but engine 'engine0' reads it "
        "for 'model.norm.weight' as dtype float32"
    ]


# -- tied parameters: one source with aliases ---------------------------------------------------


def tied_sources(shape, world: int) -> list[SourceManifest]:
    """FSDP manifests of a tied model: the embedding lists ``lm_head.weight`` as its alias."""
    out = []
    for m in fsdp_sources(hf_parameter_shapes(shape), world):
        ts = tuple(
            dataclasses.replace(t, aliases=("lm_head.weight",))
            if t.name == "model.embed_tokens.weight"
            else t
            for t in m.tensors
        )
        out.append(dataclasses.replace(m, tensors=ts))
    return out


@pytest.mark.parametrize("engine_tied", [True, False])
def test_tied_trainer_is_one_source(engine_tied):
    tied = qwen3_shape(864, tie=True)
    sources = tied_sources(tied, 3)
    assert all("lm_head.weight" not in {t.name for t in m.tensors} for m in sources)
    engine_shape = tied if engine_tied else qwen3_shape(864)
    dests = engines_for(engine_shape, 2)
    schedule = plan(sources, dests)
    assert {w.source for r in schedule.ranks for t in r.tasks for w in t.writes} >= {
        "model.embed_tokens.weight"
    }
    assert "lm_head.weight" not in {
        w.source for r in schedule.ranks for t in r.tasks for w in t.writes
    }
    g = torch.Generator().manual_seed(9)
    full = {
        n: torch.randn(s, generator=g).to(torch.bfloat16)
        for n, s in hf_parameter_shapes(tied).items()
    }
    mems = simulate_schedule(schedule, sources, dests, full)
    # The engine's lm_head (untied engine) is the embedding's rows, sliced by the test.
    full["lm_head.weight"] = full["model.embed_tokens.weight"]
    for e, d in enumerate(dests):
        expect = materialize(
            vllm_recipes(engine_shape, e, 2), vllm_tensor_specs(engine_shape, e, 2), full
        )
        assert ("lm_head.weight" in expect) is not engine_tied
        for t in d.tensors:
            n = numel(t.shape) * dtype_size(t.dtype)
            got = torch.frombuffer(
                bytearray(mems[d.engine][t.offset_bytes : t.offset_bytes + n]), dtype=torch.uint8
            )
            assert torch.equal(got, expect[t.name].contiguous().view(-1).view(torch.uint8))


def test_untied_trainer_into_tied_engine_and_inconsistent_aliases():
    # An untied trainer's lm_head cannot go into a tied engine: it is an extra tensor.
    sources = fsdp_sources(hf_parameter_shapes(qwen3_shape(864)), 2)
    probs = problems_of(sources, engines_for(qwen3_shape(864, tie=True), 2))
    assert probs == ["trainer tensor 'lm_head.weight' is read by no engine recipe (extra tensor)"]
    # Ranks that disagree about an alias, or list an alias as a tensor too.
    tied = tied_sources(qwen3_shape(864, tie=True), 2)
    ts = tuple(
        dataclasses.replace(t, aliases=("lm_head.weight",))
        if t.name == "model.norm.weight"
        else dataclasses.replace(t, aliases=())
        if t.name == "model.embed_tokens.weight"
        else t
        for t in tied[1].tensors
    )
    tied[1] = dataclasses.replace(tied[1], tensors=ts)
    probs = problems_of(tied, engines_for(qwen3_shape(864, tie=True), 2))
    assert any(
        "'lm_head.weight' is an alias of 'model.norm.weight', but another rank lists it as an "
        "alias of 'model.embed_tokens.weight'" in p
        for p in probs
    ), probs
    extra = SourceTensor(
        "lm_head.weight", (1000, 256), "bfloat16", ((0, 1000), (0, 256)), (0,), "cpu"
    )
    tied = tied_sources(qwen3_shape(864, tie=True), 1)
    tied[0] = dataclasses.replace(tied[0], tensors=tied[0].tensors + (extra,))
    probs = problems_of(tied, engines_for(qwen3_shape(864, tie=True), 1))
    assert any("listed both as a tensor and as an alias" in p for p in probs), probs


# Every FSDP shard of this model is whole 128-row blocks at 2 trainer ranks (q: 512 rows, k/v:
# 256, experts' gate/up: 256, their down: 512, dense MLP: 512), GQA included: 8 query heads
# over 4 kv heads.
BLOCK_ROWS = ModelShape(
    vocab_size=1000,
    hidden_size=512,
    intermediate_size=512,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    num_experts=2,
    moe_intermediate_size=256,
    first_k_dense=1,
)


def _block_row_setup(world: int, tp: int):
    sources = fsdp_sources(hf_parameter_shapes(BLOCK_ROWS), world)
    dests = [
        engine_manifest(
            f"engine{e}",
            vllm_recipes(BLOCK_ROWS, e, tp, fp8=True),
            vllm_tensor_specs(BLOCK_ROWS, e, tp, fp8=True),
        )
        for e in range(tp)
    ]
    return sources, dests


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_units_on_block_row_shards_are_quantized_from_the_shards(tp):
    """Units whose shards split them on block rows need no gather, and give the same bytes."""
    sources, dests = _block_row_setup(2, tp)
    schedule = plan(sources, dests)
    gathered = plan(sources, dests, PlannerConfig(quantize_in_shards=False))
    assert all(t.kind == "direct" for r in schedule.ranks for t in r.tasks)
    assert any(t.kind == "gather" for r in gathered.ranks for t in r.tasks)
    # Each rank quantizes only rows of its own shards (FSDP chunks of 2 ranks: the first or
    # the second half of every source's rows).
    for r in schedule.ranks:
        for t in r.tasks:
            for w in t.writes:
                if isinstance(w, QuantWrite):
                    for p in w.parts:
                        half = hf_parameter_shapes(BLOCK_ROWS)[p.source][0] // 2
                        a, b = p.source_box[0]
                        assert r.rank * half <= a < b <= (r.rank + 1) * half, (r.rank, w.dest, p)
    if tp == 1:
        # An expert's fused gate_up [512 rows] is four bands: gate rows 0-127 (rank 0), 128-255
        # (rank 1), up rows 0-127 (rank 0), 128-255 (rank 1).
        w13 = {
            (r.rank, w.dest_box[1])
            for r in schedule.ranks
            for t in r.tasks
            for w in t.writes
            if isinstance(w, QuantWrite) and w.dest.endswith("routed_experts.w13_weight")
        }
        assert w13 == {(0, (0, 128)), (1, (128, 256)), (0, (256, 384)), (1, (384, 512))}
    assert schedule.bytes_per_engine == gathered.bytes_per_engine
    assert_reference_layout(schedule, sources, dests, BLOCK_ROWS, tp, True, seed=5)


def test_fp8_unit_split_inside_a_block_is_gathered():
    """Shards of 96 rows (3 ranks over 288): a block would mix two ranks' rows, so gather."""
    shape = dataclasses.replace(
        BLOCK_ROWS, hidden_size=288, num_heads=4, num_kv_heads=4, head_dim=72
    )
    sources, dests = (
        fsdp_sources(hf_parameter_shapes(shape), 3),
        [
            engine_manifest(
                "engine0",
                vllm_recipes(shape, 0, 1, fp8=True),
                vllm_tensor_specs(shape, 0, 1, fp8=True),
            )
        ],
    )
    schedule = plan(sources, dests)
    gathers = {n for r in schedule.ranks for t in r.tasks if t.kind == "gather" for n in t.gather}
    assert "model.layers.0.self_attn.o_proj.weight" in gathers


def test_local_quant_units_are_batched_into_tasks_of_the_target_size():
    sources, dests = _block_row_setup(2, 1)
    for target in (1 << 30, 256 << 10):
        s = plan(sources, dests, PlannerConfig(task_target_bytes=target))
        for r in s.ranks:
            quant = [t for t in r.tasks if any(isinstance(w, QuantWrite) for w in t.writes)]
            units = sum(len(t.writes) for t in quant)
            assert units > 10
            if target == 1 << 30:
                assert len(quant) == 1  # everything in one task
            else:
                assert 1 < len(quant) < units
                for t in quant:  # each batch within its target, unless one unit alone is larger
                    assert t.staging_bytes <= target or len(t.writes) == 1
                    assert set(t.gather) == {p.source for w in t.writes for p in w.parts}


def test_fp8_bands_of_hsdp_replicas_are_spread_over_the_replicas():
    """HSDP: 2 replica groups of 2 FSDP shards. Every band is held by one rank of each group;
    the planner gives each to either and the bytes still equal the reference layout."""
    shapes = hf_parameter_shapes(BLOCK_ROWS)
    sources = []
    for r in range(4):
        g, i = divmod(r, 2)
        tensors = []
        for name, dims in sorted(shapes.items()):
            half = -(-dims[0] // 2)
            box = ((min(dims[0], i * half), min(dims[0], (i + 1) * half)),)
            box += tuple((0, n) for n in dims[1:])
            tensors.append(SourceTensor(name, dims, "bfloat16", box, (2 * g, 2 * g + 1), "cpu"))
        sources.append(SourceManifest(rank=r, world_size=4, host="h", tensors=tuple(tensors)))
    dests = [
        engine_manifest(
            "engine0",
            vllm_recipes(BLOCK_ROWS, 0, 1, fp8=True),
            vllm_tensor_specs(BLOCK_ROWS, 0, 1, fp8=True),
        )
    ]
    schedule = plan(sources, dests)
    assert all(t.kind == "direct" for r in schedule.ranks for t in r.tasks)
    for r in schedule.ranks:
        i = r.rank % 2  # which half of every source's rows this rank holds
        for t in r.tasks:
            for w in t.writes:
                if isinstance(w, QuantWrite):
                    for p in w.parts:
                        half = shapes[p.source][0] // 2
                        a, b = p.source_box[0]
                        assert i * half <= a < b <= (i + 1) * half, (r.rank, w.dest, p)
    per_rank = schedule.bytes_per_rank
    assert min(per_rank) > 0 and max(per_rank) <= 1.3 * min(per_rank), per_rank
    g = torch.Generator().manual_seed(9)
    full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    mems = simulate_schedule(schedule, sources, dests, full)
    specs = vllm_tensor_specs(BLOCK_ROWS, 0, 1, fp8=True)
    expect = materialize(vllm_recipes(BLOCK_ROWS, 0, 1, fp8=True), specs, full)
    d = dests[0]
    for t in d.tensors:
        n = numel(t.shape) * dtype_size(t.dtype)
        got = torch.frombuffer(
            bytearray(mems[d.engine][t.offset_bytes : t.offset_bytes + n]), dtype=torch.uint8
        )
        assert torch.equal(got, expect[t.name].contiguous().view(-1).view(torch.uint8)), t.name


def test_fp8_unit_sharded_by_columns_is_gathered():
    """Shards of 128 columns: every row band spans both ranks, so the unit is gathered."""
    from weight_transfer.planner.recipes import TensorSpec, identity, with_fp8

    sources = [
        SourceManifest(
            rank=r,
            world_size=2,
            host="h",
            tensors=(
                SourceTensor(
                    "w", (256, 256), "bfloat16", ((0, 256), (r * 128, r * 128 + 128)), (0, 1), "cpu"
                ),
            ),
        )
        for r in range(2)
    ]
    specs = [
        TensorSpec("w", (256, 256), "float8_e4m3fn"),
        TensorSpec("w_scale_inv", (2, 2), "float32"),
    ]
    dests = [engine_manifest("e", [with_fp8(identity("w", "w", (256, 256)))], specs)]
    schedule = plan(sources, dests)
    assert [t.kind for r in schedule.ranks for t in r.tasks] == ["gather", "gather"]
