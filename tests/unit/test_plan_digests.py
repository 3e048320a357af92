"""The planner's output is pinned: canonical JSON digests of schedules made by the planner at
main 1e59399 (before the planner-at-scale work of issue 43; the band cases were taken one
commit later, whose planning code is main's and whose fingerprint code gives main's bytes on
every other case here), on presets small enough for a unit
test, with FP8 bands on and off. A faster planner must produce the same bytes: same assignments,
tasks, writes, order and fingerprint."""

from __future__ import annotations

import hashlib

import pytest

from weight_transfer.planner.plan import PlannerConfig, plan, schedule_to_json
from weight_transfer.planner.presets.clusters import cluster_manifests, get_preset, with_overrides

# (preset, overrides, quantize_in_shards) -> sha256 of schedule_to_json(plan(...)) at 1e59399.
PINNED = [
    ("kimi-k2-mini", {}, True, "56be0ef67d34d994e884cc6f0bd6fd00668b4fdc6175203991081e1999220f8f"),
    (
        "kimi-k2-mini",
        {"engine.tp": 8},
        True,
        "ae944e21bf6aecd6696d32f85811df7661d7feee098d7b4c24be03f388e35a3e",
    ),
    ("kimi-k2-mini", {}, False, "993c7c78dd74a76c680678f6455bd7a620b80fd7c5636c67dc791bd1ae18fd0c"),
    # Expert shards of 2 ranks: FP8 experts quantized in bands (whole 128-row blocks per rank).
    (
        "kimi-k2-mini",
        {"trainer.expert_shard_size": 2},
        True,
        "837f899a2eadc432a60a464eb4c10861d016188fc65fc7bc539c38df1246ffec",
    ),
    (
        "kimi-k2-mini",
        {"trainer.expert_shard_size": 2, "trainer.dense_shard_size": 2},
        True,
        "e8bea26d019084cf0e01b4f10cdf2d88807b1ef58a0ba6b3460c3b4cf26d7f46",
    ),
    (
        "kimi-k2-mini",
        {"trainer.expert_shard_size": 2, "trainer.dense_shard_size": 2},
        False,
        "efe4412843d69a577490bfb2d7a923f8651b76ade1f563baa4ffc908fc213fa9",
    ),
    ("emu-dense", {}, True, "ae752dd95e44eb5af6e2c9e646d52daef74450d6d7b18927aa21a20ea3ffe007"),
    ("emu-dense-fp8", {}, True, "cad38e2f308058bf1858167c8191b2b4236881dcf2140cb2a1baa74a203c2266"),
    ("emu-moe", {}, True, "6ac3099b7a7b44f3f2f6cd652d1921474cec55d27cfd8f0ad49d8568f4bd1b18"),
    (
        "h200x2-llama8b-fp8",
        {},
        True,
        "542aca76dc748e3a72a9b97548326cc0666ebe0405f0e06c82a501fa42ab7eb3",
    ),
    (
        "h200x2-llama8b-colocated",
        {},
        True,
        "656e6e9d66a5071110d4a8cbf149f3b185d9bcde241b05c709e2f00ad8f2de23",
    ),
]


@pytest.mark.parametrize(("preset", "overrides", "bands", "digest"), PINNED)
def test_schedule_bytes_unchanged(
    preset: str, overrides: dict[str, object], bands: bool, digest: str
) -> None:
    p = get_preset(preset)
    if overrides:
        p = with_overrides(p, **overrides)
    sources, dests = cluster_manifests(p)
    schedule = plan(sources, dests, PlannerConfig(quantize_in_shards=bands))
    got = hashlib.sha256(schedule_to_json(schedule).encode()).hexdigest()
    assert got == digest, (
        f"{preset} {overrides} bands={bands}: schedule differs from the pinned one"
    )
