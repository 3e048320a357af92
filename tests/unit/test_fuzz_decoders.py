"""Fuzz every decoder that reads bytes from another process: only clean, documented errors.

Decoders: `planner.codec` (msgpack and JSON) for every control-plane message and planner
document, `RegionDescriptor.from_bytes`, the control plane's authenticated decryption, the tcp
and loopback endpoint and descriptor parsers, and the tcp receive thread's wire format (random
bytes on its socket must never write into registered memory nor stop the listener).
"""

from __future__ import annotations

import dataclasses
import secrets
import socket

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weight_transfer import protocol
from weight_transfer.backends.base import (
    ControlPlaneAuthError,
    RegionDescriptor,
    RegionRole,
    TransportConfig,
    TransportError,
    WeightTransferError,
    WriteOp,
    create_transport,
)
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import ControlPlaneConfig
from weight_transfer.control import ControlPlane
from weight_transfer.planner import codec
from weight_transfer.planner.types import (
    DestManifest,
    RankSchedule,
    Recipe,
    Schedule,
    SourceManifest,
)

MESSAGES = [
    c
    for c in vars(protocol).values()
    if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == protocol.__name__
]
DOCUMENTS = [SourceManifest, DestManifest, Recipe, Schedule]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Plain msgpack-able values, nested: the shapes an attacker can actually send.
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(0, 9), inner, max_size=5)
    ),
    max_leaves=30,
)


def test_every_message_class_is_fuzzed() -> None:
    assert {c.__name__ for c in MESSAGES} >= {
        "Hello",
        "Claim",
        "TrainerJoin",
        "EngineJoin",
        "RankPlan",
        "EnginePeer",
        "Failure",
        "Go",
        "Done",
        "Decision",
        "Digests",
    }


@FAST
@given(cls=st.sampled_from(MESSAGES + DOCUMENTS), data=st.binary(max_size=200))
def test_codec_msgpack_random_bytes(cls: type, data: bytes) -> None:
    try:
        codec.from_msgpack(cls, data)
    except ValueError:
        pass


@FAST
@given(cls=st.sampled_from(MESSAGES + DOCUMENTS), value=plain)
def test_codec_msgpack_random_structures(cls: type, value: object) -> None:
    try:
        codec.from_msgpack(cls, msgpack.packb(value, use_bin_type=True))
    except ValueError:
        pass


@FAST
@given(cls=st.sampled_from(DOCUMENTS), text=st.text(max_size=200))
def test_codec_json_random_text(cls: type, text: str) -> None:
    try:
        codec.from_json(cls, text)
    except ValueError:
        pass


_PLAN = protocol.RankPlan(
    fingerprint="f" * 64,
    schedule=RankSchedule(
        rank=1, tasks=(), peers=("e0", "e1"), version_engines=("e1",), memory_budget_bytes=1 << 20
    ),
    engines=(
        protocol.EnginePeer(
            name="e0", endpoint=b"ep0", descriptors=(b"d0", b"v0"), version_region=1
        ),
        protocol.EnginePeer(name="e1", endpoint=b"ep1", descriptors=(b"v1",), version_region=0),
    ),
)

_VALID = [
    _PLAN,
    protocol.Done(rank=1, step=3, ok=False, error="x", nbytes=10, seconds=0.5),
    protocol.Decision(step=2, ok=True, error=""),
    protocol.Digests(engine="e0", step=1, version=1, digests=(("a", "00"),)),
    protocol.Claim(member="engine 'e0'", nonce=bytes(range(16))),
]


@FAST
@given(index=st.integers(0, len(_VALID) - 1), flips=st.lists(st.integers(0, 10_000), max_size=4))
def test_codec_bit_flipped_messages(index: int, flips: list[int]) -> None:
    good = _VALID[index]
    raw = bytearray(codec.to_msgpack(good))
    for f in flips:
        raw[f % len(raw)] ^= 1 << (f % 8)
    try:
        decoded = codec.from_msgpack(type(good), bytes(raw))
    except ValueError:
        return
    assert type(decoded) is type(good)


def test_rank_plan_schema() -> None:
    """A trainer rank's plan decodes to what was sent; each engine's part travels as one record,
    and a plan whose parts disagree (or one in the old parallel-tuple layout) is refused."""
    assert codec.from_msgpack(protocol.RankPlan, codec.to_msgpack(_PLAN)) == _PLAN
    plain_plan = codec.to_plain(_PLAN)
    bad = [
        # the old layout: three tuples keyed by engine name
        {
            **{k: v for k, v in plain_plan.items() if k != "engines"},
            "endpoints": [["e0", b"ep0"], ["e1", b"ep1"]],
            "descriptors": [["e0", [b"d0", b"v0"]], ["e1", [b"v1"]]],
            "version_regions": [["e0", 1], ["e1", 0]],
        },
        # a version region that is not one of the engine's regions
        {**plain_plan, "engines": [{**plain_plan["engines"][0], "version_region": 2}]},
        # engines other than the schedule's peers, or in another order
        {**plain_plan, "engines": plain_plan["engines"][:1]},
        {**plain_plan, "engines": plain_plan["engines"][::-1]},
        # a field of the wrong type
        {**plain_plan, "engines": [{**plain_plan["engines"][0], "endpoint": "ep0"}]},
    ]
    for data in bad:
        with pytest.raises(ValueError):
            codec.from_msgpack(protocol.RankPlan, msgpack.packb(data, use_bin_type=True))


@FAST
@given(data=st.binary(max_size=100) | plain.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_region_descriptor_random_bytes(data: bytes) -> None:
    try:
        RegionDescriptor.from_bytes(data)
    except ValueError:
        pass


@pytest.fixture(scope="module")
def control_plane():
    cp = ControlPlane(
        ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=5),
        server=True,
        member="fuzz",
    )
    yield cp
    cp.close()


@FAST
@given(data=st.binary(max_size=120))
def test_control_plane_unseal_random_bytes(control_plane: ControlPlane, data: bytes) -> None:
    with pytest.raises(ControlPlaneAuthError):
        control_plane.unseal("wt/default/go/1", data)


@FAST
@given(flip=st.integers(0, 10_000))
def test_control_plane_unseal_tampered_and_moved(control_plane: ControlPlane, flip: int) -> None:
    sealed = bytearray(control_plane.seal("wt/default/go/1", codec.to_msgpack(protocol.Go(step=1))))
    assert codec.from_msgpack(protocol.Go, control_plane.unseal("wt/default/go/1", bytes(sealed)))
    with pytest.raises(ControlPlaneAuthError):
        control_plane.unseal("wt/default/go/2", bytes(sealed))  # replayed under another key
    sealed[flip % len(sealed)] ^= 1 << (flip % 8)
    with pytest.raises(ControlPlaneAuthError):
        control_plane.unseal("wt/default/go/1", bytes(sealed))


@pytest.fixture(scope="module", params=["loopback", "tcp"])
def transport(request):
    t = create_transport(TransportConfig(name=request.param, connect_timeout_s=2))
    yield t
    t.close()


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=80) | plain.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_endpoint_parsers_random_bytes(transport, data: bytes) -> None:
    try:
        transport.connect("fuzz-peer", data)
    except (ValueError, WeightTransferError):
        pass  # ConfigurationError / TransportError / PeerLost / timeout are WeightTransferErrors
    else:
        transport.disconnect("fuzz-peer")


@settings(max_examples=25, deadline=None)
@given(payload=st.binary(max_size=60) | plain.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_tcp_descriptor_payload_random_bytes(payload: bytes) -> None:
    with (
        create_transport(TransportConfig(name="tcp")) as a,
        create_transport(TransportConfig(name="tcp")) as b,
    ):
        src = a.register(torch.arange(16, dtype=torch.uint8), role=RegionRole.SOURCE)
        a.connect("b", b.endpoint())
        desc = RegionDescriptor(backend="tcp", kind=src.kind, nbytes=16, payload=payload)
        with pytest.raises(ValueError):
            a.post_writes("b", [WriteOp(src, 0, desc, 0, 16)])


@pytest.fixture(scope="module")
def tcp_target():
    t = create_transport(TransportConfig(name="tcp", connect_timeout_s=2))
    memory = torch.randint(
        0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    region = t.register(memory, role=RegionRole.TARGET)
    yield t, region, memory.clone()
    t.close()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.binary(min_size=1, max_size=300), with_handshake=st.booleans())
def test_tcp_wire_random_bytes_write_nothing(
    tcp_target, garbage: bytes, with_handshake: bool
) -> None:
    t, region, before = tcp_target
    ep = msgpack.unpackb(t.endpoint(), raw=False)
    with socket.create_connection((ep["host"], ep["port"]), timeout=5) as s:
        # The listener may refuse and reset the connection at any point: a reset is a valid
        # answer to garbage, so every socket call below may raise OSError.
        try:
            if with_handshake:
                import struct

                s.sendall(struct.pack("!4sHxxQ", b"WTT1", 1, 0))
                s.recv(16)
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            while s.recv(4096):
                pass  # the listener answers (error frame) or closes; it never hangs
        except OSError:
            pass
    assert torch.equal(region.tensor.view(torch.uint8), before)
    # The listener is still alive: a proper peer still connects.
    with create_transport(TransportConfig(name="tcp")) as peer:
        peer.connect("t", t.endpoint())


def test_tcp_transport_errors_are_weight_transfer_errors() -> None:
    assert issubclass(TransportError, WeightTransferError)
