"""Each member binds and advertises its own address, never the control plane's (issue 23)."""

from __future__ import annotations

import socket

import msgpack
import pytest

from weight_transfer.addresses import MemberAddress, member_address, route_address
from weight_transfer.backends.base import ConfigurationError, TransportConfig, TransportError
from weight_transfer.backends.tcp import TcpTransport
from weight_transfer.config import (
    ControlPlaneConfig,
    TransferConfig,
    config_from_mapping,
    new_token,
)
from weight_transfer.engines.vllm import EngineInitInfo, TrainerInitInfo

TOKEN = new_token()


def test_route_to_the_control_plane_gives_this_hosts_own_address() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("localhost") == "127.0.0.1"
    # 127.0.0.2 is another address on loopback: the route to it leaves from 127.0.0.1, which is
    # what a member must bind (binding the control host's address works only on that host).
    assert route_address("127.0.0.2") == "127.0.0.1"


def test_member_address_rules() -> None:
    assert member_address("127.0.0.2") == MemberAddress("127.0.0.1", "127.0.0.1")
    assert member_address("127.0.0.2", "127.0.0.3") == MemberAddress("127.0.0.3", "127.0.0.3")
    assert member_address("127.0.0.2", "127.0.0.3", "10.9.9.9") == MemberAddress(
        "127.0.0.3", "10.9.9.9"
    )
    assert member_address("127.0.0.2", "0.0.0.0") == MemberAddress("0.0.0.0", "127.0.0.1")
    assert member_address("127.0.0.2", "localhost") == MemberAddress("127.0.0.1", "127.0.0.1")
    with pytest.raises(ConfigurationError, match="does not resolve"):
        member_address("no-such-host.invalid")
    with pytest.raises(ConfigurationError, match="listen_host must be a non-empty address"):
        member_address("127.0.0.1", " ")
    with pytest.raises(ConfigurationError, match="is a wildcard"):
        member_address("127.0.0.1", None, "0.0.0.0")


def _toml_config(**top: object):
    return config_from_mapping(
        {"transport": "tcp", "control": {"host": "127.0.0.2", "token": TOKEN}, **top}
    )


def test_transfer_config_binds_its_own_address_not_the_control_hosts() -> None:
    """Before, `TransferConfig.transport_config()` set listen_host to control.host: on any
    host but trainer rank 0's the tcp transport could not listen."""
    tc = _toml_config().transport_config()
    assert (tc.listen_host, tc.advertise_host) == ("127.0.0.1", "127.0.0.1")
    tc = _toml_config(listen_host="0.0.0.0", advertise_host="10.1.2.3").transport_config()
    assert (tc.listen_host, tc.advertise_host) == ("0.0.0.0", "10.1.2.3")
    with pytest.raises(ValueError, match="listen_host must be a non-empty address"):
        _toml_config(listen_host="")
    with pytest.raises(ValueError, match="config.advertise_host: expected a string, got int 5"):
        _toml_config(advertise_host=5)  # the file's types are checked first
    with pytest.raises(ValueError, match="advertise_host must be a non-empty address"):
        TransferConfig(control=ControlPlaneConfig(token=TOKEN), advertise_host=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is a wildcard"):
        _toml_config(advertise_host="::")


def test_vllm_init_infos_resolve_each_member_on_its_own_host() -> None:
    info = EngineInitInfo.from_config(_toml_config())
    tc = info.transfer_config().transport_config()
    assert (tc.listen_host, tc.advertise_host) == ("127.0.0.1", "127.0.0.1")
    # What rank 0 sends to the workers leaves the address to each of them, whatever the
    # trainer rank's own file says.
    trainer = TrainerInitInfo(
        config=_toml_config(num_engines=1, listen_host="0.0.0.0"), rank=1, world_size=2
    )
    assert trainer.config.transport_config().listen_host == "0.0.0.0"
    assert trainer.config.transport_config().advertise_host == "127.0.0.1"
    sent = EngineInitInfo(**trainer.engine_init_info().to_dict()).transfer_config()
    assert sent.listen_host is None and sent.advertise_host is None
    tc = sent.transport_config()  # what a worker on this host resolves
    assert (tc.listen_host, tc.advertise_host) == ("127.0.0.1", "127.0.0.1")


def _endpoint(t: TcpTransport) -> dict[str, object]:
    return dict(msgpack.unpackb(t.endpoint(), raw=False))


def test_tcp_listens_in_its_port_range_and_advertises_its_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    span = f"{base}-{base + 1}"
    made = []
    try:
        for _ in range(2):
            cfg = TransportConfig(
                name="tcp",
                listen_host="127.0.0.1",
                advertise_host="127.0.0.1",
                options=(("port_range", span),),
            )
            made.append(TcpTransport(cfg))
        ports = sorted(int(_endpoint(t)["port"]) for t in made)  # type: ignore[call-overload]
        assert ports == [base, base + 1]
        assert all(_endpoint(t)["host"] == "127.0.0.1" for t in made)
        with pytest.raises(TransportError, match=f"ports {base}-{base + 1}"):
            TcpTransport(TransportConfig(name="tcp", options=(("port_range", span),)))
    finally:
        for t in made:
            t.close()
    for bad in ("abc", "10-5", "0-70000"):
        with pytest.raises(ConfigurationError, match="port_range"):
            TcpTransport(TransportConfig(name="tcp", options=(("port_range", bad),)))
    wild = TcpTransport(TransportConfig(name="tcp", listen_host="0.0.0.0", advertise_host="h1"))
    try:
        assert _endpoint(wild)["host"] == "h1"
    finally:
        wild.close()
