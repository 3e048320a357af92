"""A small emulated cluster for real: 2 trainer hosts and 2 engine hosts as network namespaces
on a bridge, every link shaped with tc tbf (`weight_transfer.benchmarks.netns`).

Runs `weight_transfer.benchmarks.emulate.run` on the `emu-dense` model (27 MB of BF16) with 2
FSDP trainer ranks into one engine replica of tp 2, over the tcp backend, plus the rank-0
funnel. Checks that every update (ours and the funnel's) verified, that the engines' final
tensors are bit-exact against slicing written here of the seeded weights, that the
measured/predicted ratio and the ceiling are reported (no timing bound: speed targets live in
benchmarks/results/emulate_*), and that no namespace is left behind, also when the body of a
cluster raises. Needs root (CI has it); skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from weight_transfer.benchmarks.emulate import EmulateConfig, _param, run
from weight_transfer.benchmarks.netns import (
    EmulatedCluster,
    LinkShape,
    leftover_namespaces,
    tool_path,
    unavailable_reason,
)
from weight_transfer.planner.presets.clusters import get_preset, source_manifests, with_overrides

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _expected(full: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """vLLM's tp=2 layout of rank k, sliced here (column-parallel rows, row-parallel columns,
    fused qkv and gate_up), independently of the planner's recipes."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // 2
        return t[k * n : (k + 1) * n]

    def cols(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // 2
        return t[:, k * n : (k + 1) * n]

    out = {
        "model.embed_tokens.weight": rows(full["model.embed_tokens.weight"]),
        "model.norm.weight": full["model.norm.weight"],
        "lm_head.weight": rows(full["lm_head.weight"]),
    }
    for i in range(3):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [rows(full[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"]
        )
        out[p + "self_attn.o_proj.weight"] = cols(full[p + "self_attn.o_proj.weight"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [rows(full[p + "mlp.gate_proj.weight"]), rows(full[p + "mlp.up_proj.weight"])]
        )
        out[p + "mlp.down_proj.weight"] = cols(full[p + "mlp.down_proj.weight"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + f"{norm}.weight"] = full[p + f"{norm}.weight"]
    return out


@pytest.mark.timeout(300)
def test_emulated_cluster_updates_are_bit_exact_and_compared_with_the_simulator(tmp_path) -> None:  # type: ignore[no-untyped-def]
    preset = with_overrides(
        get_preset("emu-dense"),
        **{
            "trainer.num_gpus": 2,
            "trainer.dense_shard_size": 2,
            "trainer.expert_shard_size": 2,
            "engine.num_replicas": 1,
        },
    )
    cfg = EmulateConfig(
        preset=preset,
        rate_mbyte_per_s=40.0,
        warmups=0,
        repeats=2,
        baseline=True,
        baseline_repeats=1,
        dump_dir=str(tmp_path),
        timeout_s=240.0,
        seed=7,
    )
    result = run(cfg)
    print({k: result[k] for k in ("measured_s", "ratio_measured_over_predicted", "ceiling")})
    print("funnel", result["funnel"]["measured_s"], result["funnel"]["predicted_s"])
    assert result["errors"] == []
    assert leftover_namespaces(result["namespaces"]) == []
    kinds = sorted((v["kind"], v["step"]) for v in result["verified"])
    assert kinds == [("funnel", 0), ("funnel", 1), ("ours", 1), ("ours", 2)], kinds
    assert all(v["mismatches"] == [] for v in result["verified"]), result["verified"]
    # The engines' tensors after our last update, against the seeded weights sliced here.
    full = {
        t.name: _param(t.name, t.shape, torch.bfloat16, cfg.seed, cfg.repeats)
        for t in source_manifests(preset)[0].tensors
    }
    for k in range(2):
        want = _expected(full, k)
        files = sorted(os.listdir(tmp_path / str(k)))
        assert files == sorted(f"{n}.bin" for n in want), files
        for name, t in want.items():
            raw = (tmp_path / str(k) / f"{name}.bin").read_bytes()
            got = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(t.shape)
            assert torch.equal(got, t.contiguous()), f"engine tp{k}: {name} differs"
    # The comparison is reported (its size is a benchmark's business, not this test's).
    assert result["ceiling"]["mbyte_per_s"] > 0
    assert result["simulated"]["predicted_s"] > 0
    assert result["ratio_measured_over_predicted"] > 0
    assert result["funnel"]["ratio_measured_over_predicted"] > 0
    assert set(result["cpu_per_process"]) == {"trainer0", "trainer1", "engine0", "engine1"}


def test_namespaces_are_removed_when_the_body_fails() -> None:
    names: list[str] = []
    with (
        pytest.raises(RuntimeError, match="boom"),
        EmulatedCluster(2, LinkShape(rate_mbyte_per_s=10)) as c,
    ):
        names = [c.switch, *c.hosts]
        assert sorted(leftover_namespaces(names)) == sorted(names)
        r = subprocess.run(
            [tool_path("tc") or "tc", "-n", c.hosts[0], "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "tbf" in r.stdout and "80Mbit" in r.stdout, r.stdout
        raise RuntimeError("boom")
    assert names and leftover_namespaces(names) == []


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["emulate", "--preset", "kimi-k2"], "every rank a host of its own"),
        (["emulate", "--preset", "emu-moe", "--baseline"], "rank-0 funnel needs one FSDP mesh"),
        (
            ["emulate", "--backend", "ucx", "--repeats", "0"],
            "repeats and baseline_repeats must be >= 1",
        ),
        (
            ["emulate", "--preset", "emu-dense-fp8", "--delta-density", "0.01"],
            "delta emulation runs BF16 engines",
        ),
        (["emulate", "--delta-density", "2"], "delta_density must be in [0, 1]"),
    ],
)
def test_emulate_refuses_bad_input_in_one_line(capsys, argv: list[str], needle: str) -> None:  # type: ignore[no-untyped-def]
    from weight_transfer.cli import main

    before = set(leftover_namespaces())
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "", (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert set(leftover_namespaces()) == before  # refused before any namespace was made
