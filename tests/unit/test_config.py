"""Configuration: TOML and CLI flags fill the same dataclasses; bad values are named."""

from __future__ import annotations

import secrets

import pytest

from weight_transfer.config import (
    ControlPlaneConfig,
    SenderConfig,
    config_from_mapping,
    load_toml,
    merge,
    new_token,
    read_toml,
    token_bits,
)
from weight_transfer.planner.plan import PlannerConfig

TOKEN = new_token()

TOML = """
transport = "tcp"
connect_timeout_s = 5.0
[control]
host = "127.0.0.1"
port = 29811
token = "xOsNmkg5xHsBzlmZY7kjnbNV9YnevoHswB73Axu9t-8"
[sender]
memory_budget_bytes = 268435456
[planner]
max_write_bytes = 1048576
memory_budget_bytes = 268435456
[transport_options]
UCX_TLS = "rc,cuda_ipc"
"""


def test_toml_maps_onto_the_dataclasses(tmp_path):
    path = tmp_path / "wt.toml"
    path.write_text(TOML)
    cfg = load_toml(path)
    assert cfg.transport == "tcp"
    assert cfg.control == ControlPlaneConfig(
        host="127.0.0.1", port=29811, token="xOsNmkg5xHsBzlmZY7kjnbNV9YnevoHswB73Axu9t-8"
    )
    assert cfg.sender == SenderConfig(memory_budget_bytes=256 << 20)
    assert cfg.planner.max_write_bytes == 1 << 20
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
    assert cfg.sender.memory_budget_bytes == 256 << 20 and cfg.sender.update_timeout_s == 9.0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"transport": "carrier-pigeon"}, "unknown transport"),
        ({"tranport": "tcp"}, "unknown setting 'tranport'"),
        ({"sender": {"memory_budget_bytes": 0}}, "memory_budget_bytes must be positive"),
        ({"control": {"token": "short"}}, "fewer than the 128 required"),
        ({"control": {"port": 70000}}, "out of range"),
        ({"planner": {"max_write_bytes": 1 << 30, "memory_budget_bytes": 1 << 30}}, "at most half"),
    ],
)
def test_bad_values_are_named(data, message):
    with pytest.raises(ValueError, match=message):
        config_from_mapping(merge({"control": {"token": TOKEN}}, data))


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
