"""Configuration: TOML and CLI flags fill the same dataclasses; bad values are named; the vLLM
init infos are derived from the one config."""

from __future__ import annotations

import dataclasses
import re
import secrets
from pathlib import Path

import pytest

from weight_transfer.config import (
    PUBLISHED_SAMPLE_TOKENS,
    ControlPlaneConfig,
    DeltaConfig,
    ReceiverConfig,
    SenderConfig,
    TransferConfig,
    VllmConfig,
    config_from_mapping,
    config_to_mapping,
    load_toml,
    merge,
    new_token,
    read_toml,
    token_bits,
)
from weight_transfer.errors import ConfigurationError
from weight_transfer.planner.plan import PlannerConfig

ROOT = Path(__file__).resolve().parents[2]
TOKEN = new_token()

TOML = f"""
transport = "tcp"
connect_timeout_s = 5.0
num_engines = 4
listen_host = "127.0.0.1"
advertise_host = "127.0.0.1"
[control]
host = "127.0.0.1"
port = 29811
token = "{TOKEN}"
[sender]
update_timeout_s = 12.5
record_trace = false
[sender.delta]
enabled = true
anchor_every_updates = 4
kernels = "triton"
[receiver]
allow_unwritten = true
patch_region_bytes = 1048576
patch_kernels = "cuda"
update_window = true
[planner]
max_write_bytes = 1048576
memory_budget_bytes = 268435456
[vllm]
engine_prefix = "rollout"
publish_digests = true
hf_moe_layout = "fused"
[transport_options]
UCX_TLS = "rc,cuda_ipc"
"""


def test_load_toml_takes_the_token_from_the_caller_over_the_file(tmp_path):
    """A file without a token (the way to keep it out of files others read) plus the token
    from the caller; a bad token is refused as from the file."""
    path = tmp_path / "wt.toml"
    path.write_text('transport = "tcp"\n[control]\nport = 29811\n')
    other = secrets.token_hex(16)
    assert load_toml(path, token=other).control.token == other
    path.write_text(TOML)
    assert load_toml(path, token=other).control.token == other
    assert load_toml(path).control.token == TOKEN
    with pytest.raises(ConfigurationError, match="token"):
        load_toml(path, token="short")


def test_toml_maps_onto_the_dataclasses(tmp_path):
    path = tmp_path / "wt.toml"
    path.write_text(TOML)
    cfg = load_toml(path)
    assert cfg.transport == "tcp" and cfg.connect_timeout_s == 5.0 and cfg.num_engines == 4
    assert cfg.control == ControlPlaneConfig(host="127.0.0.1", port=29811, token=TOKEN)
    assert (cfg.listen_host, cfg.advertise_host) == ("127.0.0.1", "127.0.0.1")
    assert cfg.sender == SenderConfig(
        update_timeout_s=12.5,
        record_trace=False,
        delta=DeltaConfig(enabled=True, anchor_every_updates=4, kernels="triton"),
    )
    assert cfg.receiver == ReceiverConfig(
        allow_unwritten=True, patch_region_bytes=1 << 20, patch_kernels="cuda", update_window=True
    )
    assert cfg.planner == PlannerConfig(memory_budget_bytes=256 << 20, max_write_bytes=1 << 20)
    assert cfg.vllm == VllmConfig(
        engine_prefix="rollout", publish_digests=True, hf_moe_layout="fused"
    )
    assert cfg.transport_options == (("UCX_TLS", "rc,cuda_ipc"),)
    tc = cfg.transport_config(device_index=0)
    assert tc.name == "tcp" and tc.device_index == 0 and tc.option("UCX_TLS") == "rc,cuda_ipc"


def test_cli_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "wt.toml"
    path.write_text(TOML)
    cfg = config_from_mapping(
        merge(read_toml(path), {"transport": "loopback", "sender": {"update_timeout_s": 9.0}})
    )
    assert cfg.transport == "loopback"
    assert cfg.planner.memory_budget_bytes == 256 << 20 and cfg.sender.update_timeout_s == 9.0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"transport": "carrier-pigeon"}, "unknown transport"),
        ({"tranport": "tcp"}, "unknown setting 'tranport'"),
        ({"planer": {"memory_budget_bytes": 1}}, r"unknown table \[planer\]; known tables: "),
        ({"sender": {"memory_budget_bytes": 1}}, "config.sender: unknown setting 'memory_budget"),
        ({"planner": {"memory_budget_bytes": 0}}, "memory_budget_bytes must be positive"),
        ({"num_engines": 0}, "num_engines must be positive"),
        ({"vllm": {"hf_moe_layout": "stacked"}}, "hf_moe_layout must be one of"),
        ({"transport_options": {"UCX_TLS": ""}}, "transport option 'UCX_TLS' is empty"),
        ({"control": {"token": "short"}}, "fewer than the 128 required"),
        ({"control": {"port": 70000}}, "out of range"),
        ({"planner": {"max_write_bytes": 1 << 30, "memory_budget_bytes": 1 << 30}}, "at most half"),
    ],
)
def test_bad_values_are_named(data, message):
    with pytest.raises(ConfigurationError, match=message) as info:
        config_from_mapping(merge({"control": {"token": TOKEN}}, data))
    assert "\n" not in str(info.value)  # one line


def test_invalid_toml_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("transport = ")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(path)


def test_defaults_are_valid_and_the_token_has_none():
    assert PlannerConfig() == config_from_mapping({"control": {"token": TOKEN}}).planner
    with pytest.raises(ValueError, match="missing.*'control'"):
        config_from_mapping({})
    with pytest.raises(ValueError, match="token is required"):
        ControlPlaneConfig()


@pytest.mark.parametrize(
    "token",
    [
        "change-me-please",
        "a-long-shared-secret",
        secrets.token_hex(8),
        "ab" * 32,
        "a" * 100,
    ],
)
def test_weak_tokens_are_refused(token):
    with pytest.raises(ValueError, match="fewer than the 128 required"):
        ControlPlaneConfig(token=token)


def test_generated_tokens_pass():
    for _ in range(200):
        ControlPlaneConfig(token=new_token())
        ControlPlaneConfig(token=secrets.token_hex(16))
    assert token_bits(new_token()) >= 250


def test_cli_prints_a_fresh_token(capsys):
    from weight_transfer.cli import main

    assert main(["token"]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["token"]) == 0
    second = capsys.readouterr().out.strip()
    assert first != second and token_bits(first) >= 250
    ControlPlaneConfig(token=first)


def test_every_field_maps_and_round_trips(tmp_path):
    """The TOML file maps the config completely: the plain data of a config with every field
    set away from its default builds the same config again."""
    path = tmp_path / "wt.toml"
    path.write_text(TOML)
    cfg = load_toml(path)
    for f in dataclasses.fields(TransferConfig):
        default = TransferConfig(control=cfg.control)
        if f.name != "control":
            assert getattr(cfg, f.name) != getattr(default, f.name), f"{f.name} left default"
    assert config_from_mapping(config_to_mapping(cfg)) == cfg
    assert config_from_mapping(config_to_mapping(TransferConfig(control=cfg.control))) == (
        TransferConfig(control=cfg.control)
    )


def test_one_memory_budget_and_writes_within_it():
    # The sender has no budget of its own; the planner's default write size follows the budget,
    # so a small budget alone is a valid config.
    assert "memory_budget_bytes" not in {f.name for f in dataclasses.fields(SenderConfig)}
    small = PlannerConfig(memory_budget_bytes=8 << 20)
    assert small.write_limit_bytes == 2 << 20
    assert PlannerConfig().write_limit_bytes == 64 << 20
    assert PlannerConfig(max_write_bytes=1 << 20).write_limit_bytes == 1 << 20


def test_published_sample_tokens_are_refused():
    """Every token the README and docs print as a sample is refused (anyone can read it)."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    samples = set()
    for path in texts:
        samples |= set(re.findall(r'token\s*=\s*"([^"]+)"', path.read_text()))
    assert samples, "docs/configuration.md shows a sample token in its TOML example"
    assert samples <= PUBLISHED_SAMPLE_TOKENS, samples - PUBLISHED_SAMPLE_TOKENS
    for token in PUBLISHED_SAMPLE_TOKENS:
        assert token_bits(token) >= 128  # it would pass as random: only the list refuses it
        with pytest.raises(ConfigurationError, match="sample printed in this project's docs"):
            ControlPlaneConfig(token=token)


def test_vllm_init_infos_are_derived_from_the_config_and_hide_the_token(tmp_path):
    from weight_transfer.engines.vllm import EngineInitInfo, TrainerInitInfo

    path = tmp_path / "wt.toml"
    path.write_text(TOML)
    cfg = load_toml(path)
    info = TrainerInitInfo(config=cfg, rank=1, world_size=2)
    assert not info.is_sender
    engine = info.engine_init_info()
    # What vLLM does with the dict it receives: EngineInitInfo(**init_info).
    rebuilt = EngineInitInfo(**engine.to_dict())
    # All of it but this trainer rank's own addresses: each worker resolves its own.
    assert rebuilt.transfer_config() == dataclasses.replace(
        cfg, listen_host=None, advertise_host=None
    )
    for shown in (repr(info), str(info), repr(engine), repr(rebuilt), str(engine.to_dict)):
        assert TOKEN not in shown, shown
    # The engine side has no defaults of its own: nothing but the config.
    assert [f.name for f in dataclasses.fields(EngineInitInfo)] == ["config"]
    with pytest.raises(ConfigurationError, match="config.control.port"):
        EngineInitInfo(**merge(engine.to_dict(), {"config": {"control": {"port": "x"}}}))
    with pytest.raises(ConfigurationError, match="num_engines is not set"):
        TrainerInitInfo(config=dataclasses.replace(cfg, num_engines=None), rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="rank 2 is outside world_size 2"):
        TrainerInitInfo(config=cfg, rank=2, world_size=2)
    # Without a process group: rank 0 of 1.
    solo = TrainerInitInfo(config=cfg)
    assert (solo.rank, solo.world_size, solo.is_sender) == (0, 1, True)
