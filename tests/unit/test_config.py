"""Configuration: TOML and CLI flags fill the same dataclasses; bad values are named."""

from __future__ import annotations

import pytest

from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.transfer.config import (
    ControlPlaneConfig,
    SenderConfig,
    TransferConfig,
    config_from_mapping,
    load_toml,
    merge,
    read_toml,
)

TOML = """
transport = "tcp"
connect_timeout_s = 5.0
[control]
host = "127.0.0.1"
port = 29811
token = "a-long-shared-secret"
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
    assert cfg.control == ControlPlaneConfig(host="127.0.0.1", port=29811, token="a-long-shared-secret")
    assert cfg.sender == SenderConfig(memory_budget_bytes=256 << 20)
    assert cfg.planner.max_write_bytes == 1 << 20
    assert cfg.transport_options == (("UCX_TLS", "rc,cuda_ipc"),)
    tc = cfg.transport_config(device_index=0)
    assert tc.name == "tcp" and tc.device_index == 0 and tc.option("UCX_TLS") == "rc,cuda_ipc"


def test_cli_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "wt.toml"
    path.write_text(TOML)
    cfg = config_from_mapping(merge(read_toml(path), {"transport": "loopback", "sender": {"update_timeout_s": 9.0}}))
    assert cfg.transport == "loopback"
    assert cfg.sender.memory_budget_bytes == 256 << 20 and cfg.sender.update_timeout_s == 9.0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"transport": "carrier-pigeon"}, "unknown transport"),
        ({"tranport": "tcp"}, "unknown setting 'tranport'"),
        ({"sender": {"memory_budget_bytes": 0}}, "memory_budget_bytes must be positive"),
        ({"control": {"token": "short"}}, "at least 8 characters"),
        ({"control": {"port": 70000}}, "out of range"),
        ({"planner": {"max_write_bytes": 1 << 30, "memory_budget_bytes": 1 << 30}}, "at most half"),
    ],
)
def test_bad_values_are_named(data, message):
    with pytest.raises(ValueError, match=message):
        config_from_mapping(data)


def test_invalid_toml_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("transport = ")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(path)


def test_defaults_are_valid():
    TransferConfig()
    PlannerConfig()
