"""The schema-checked decoder's errors, and that it resolves each class's type hints once.

Field lists and type hints are resolved once per class (`codec._schema`); these pin what a
decoder still rejects after that change, with the path of the offending field.
"""

from __future__ import annotations

import dataclasses

import pytest

from weight_transfer.planner import codec
from weight_transfer.protocol import Done, Hello


@dataclasses.dataclass(frozen=True, slots=True)
class Inner:
    n: int
    tag: str = "x"


@dataclasses.dataclass(frozen=True, slots=True)
class Outer:
    inner: Inner
    items: tuple[Inner, ...]
    ratio: float
    flag: bool
    note: str | None = None


GOOD = {"inner": {"n": 1}, "items": [{"n": 2, "tag": "y"}], "ratio": 3, "flag": True}


def test_round_trip_with_defaults() -> None:
    got = codec.from_msgpack(Outer, codec.to_msgpack(codec.from_plain(Outer, GOOD)))
    assert got == Outer(Inner(1), (Inner(2, "y"),), 3.0, True, None)
    assert isinstance(got.ratio, float)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({**GOOD, "extra": 1}, r"\$: unknown field\(s\) \['extra'\] for Outer"),
        ({k: v for k, v in GOOD.items() if k != "flag"}, r"\$: missing field 'flag' of Outer"),
        ({**GOOD, "inner": {}}, r"\$\.inner: missing field 'n' of Inner"),
        ({**GOOD, "inner": {"n": True}}, r"\$\.inner\.n: expected int, got bool"),
        ({**GOOD, "flag": 1}, r"\$\.flag: expected bool, got int"),
        ({**GOOD, "ratio": False}, r"\$\.ratio: expected number, got bool"),
        ({**GOOD, "items": [{"n": 1, "tag": 5}]}, r"\$\.items\[0\]\.tag: expected str, got int"),
        ({**GOOD, "note": b"x"}, r"\$\.note: matches no alternative"),
        ([1, 2], r"\$: expected a map for Outer, got list"),
    ],
)
def test_rejects_with_the_path(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        codec.from_plain(Outer, data)


def test_bytes_field_and_unknown_key_types() -> None:
    hello = Hello(protocol=1, session="s", run_id=b"\x00\x01")
    assert codec.from_msgpack(Hello, codec.to_msgpack(hello)) == hello
    with pytest.raises(ValueError, match=r"\$\.run_id: expected bytes, got str"):
        codec.from_plain(Hello, {"protocol": 1, "session": "s", "run_id": "ab"})
    with pytest.raises(ValueError, match="unknown field"):
        codec.from_plain(Hello, {"protocol": 1, "session": "s", "run_id": b"", 7: 1})


def test_hints_are_resolved_once_per_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolving a class's string annotations took about 50 us of the 57 us the controller
    spent per rank report (`bench control-plane`); a second decode must not resolve them."""
    raw = codec.to_msgpack(Done(rank=1, step=1, ok=True, error="", nbytes=1, seconds=0.5))
    first = codec.from_msgpack(Done, raw)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("type hints resolved again")

    monkeypatch.setattr(codec.typing, "get_type_hints", refuse)
    assert codec.from_msgpack(Done, raw) == first
