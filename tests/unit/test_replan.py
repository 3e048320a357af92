"""Re-planning after an engine rejoins (`planner.replan.Replanner`): the reused schedule equals a
plan from scratch, and only the tasks writing into the rejoined engine are rebuilt."""

from __future__ import annotations

import dataclasses

import pytest

from weight_transfer.errors import PlanMismatchError
from weight_transfer.planner.plan import PlannerConfig, plan, schedule_to_json
from weight_transfer.planner.presets.clusters import cluster_manifests, get_preset
from weight_transfer.planner.replan import Replanner
from weight_transfer.planner.types import DestManifest, DestRegion, DestTensor, dtype_size, numel


def _rejoined(d: DestManifest) -> DestManifest:
    """`d` as a restarted engine brings it: the same tensors in reverse order at new offsets of
    a bigger region 0, the version word in another region, new descriptors and host."""
    offset = 4096
    tensors = {}
    for t in reversed(d.tensors):
        tensors[t.name] = DestTensor(t.name, t.shape, t.dtype, 0, offset)
        offset += -(-(numel(t.shape) * dtype_size(t.dtype)) // 512) * 512 + 512
    return dataclasses.replace(
        d,
        host=d.host + "-restarted",
        regions=(
            DestRegion(0, offset, b"new:" + d.engine.encode()),
            DestRegion(3, 8, b"new-version:" + d.engine.encode()),
        ),
        tensors=tuple(tensors[t.name] for t in d.tensors),
        version_region=3,
    )


@pytest.mark.parametrize("preset", ["kimi-k2-mini", "emu-dense-fp8", "emu-moe"])
def test_rejoined_engine_replan_equals_plan_from_scratch(preset: str) -> None:
    sources, dests = cluster_manifests(get_preset(preset))
    config = PlannerConfig()
    rp = Replanner(sources, config)
    first = rp.plan(dests)
    assert not rp.reused_last
    assert schedule_to_json(first) == schedule_to_json(plan(sources, dests, config))

    k = len(dests) // 2
    target = dests[k].engine
    new_dests = [_rejoined(d) if i == k else d for i, d in enumerate(dests)]
    again = rp.plan(new_dests)
    assert rp.reused_last
    scratch = plan(sources, new_dests, config)
    assert again == scratch
    assert schedule_to_json(again) == schedule_to_json(scratch)
    assert again.fingerprint != first.fingerprint  # descriptors and host are planner inputs

    # Tasks that write nothing into the rejoined engine are the very objects of the last plan;
    # those that do changed (every tensor moved).
    num_touched = 0
    for old_rs, new_rs in zip(first.ranks, again.ranks, strict=True):
        for old_t, new_t in zip(old_rs.tasks, new_rs.tasks, strict=True):
            if any(w.engine == target for w in old_t.writes):
                num_touched += 1
                assert new_t != old_t
            else:
                assert new_t is old_t
    assert num_touched > 0

    # And back: a second rejoin (to the first placement) reuses again and matches too.
    back = rp.plan(dests)
    assert rp.reused_last
    assert back == first


def test_changed_layout_plans_from_scratch() -> None:
    sources, dests = cluster_manifests(get_preset("kimi-k2-mini"))
    rp = Replanner(sources)
    rp.plan(dests)
    # An engine removed is not a placement change: planned again, as plan() would.
    fewer = dests[:-1]
    got = rp.plan(fewer)
    assert not rp.reused_last
    assert got == plan(sources, fewer)


def test_rejoined_engine_with_bad_placement_is_refused() -> None:
    sources, dests = cluster_manifests(get_preset("emu-dense"))
    rp = Replanner(sources)
    rp.plan(dests)
    d = dests[0]
    small = dataclasses.replace(
        d, regions=(DestRegion(0, 64, b"tiny"), d.regions[1]), host="elsewhere"
    )
    with pytest.raises(PlanMismatchError, match="lies outside region 0") as got:
        rp.plan([small, *dests[1:]])
    with pytest.raises(PlanMismatchError) as want:
        plan(sources, [small, *dests[1:]])
    assert got.value.problems == want.value.problems
