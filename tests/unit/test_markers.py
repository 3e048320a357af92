"""tests/markers.py skips only for an absent package or absent hardware, never for a failure."""

from __future__ import annotations

import pytest

from tests import markers
from weight_transfer.backends.base import TransportError
from weight_transfer.backends.tcp import TcpTransport


def test_broken_constructor_is_not_a_reason_to_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, *args: object, **kwargs: object) -> None:
        raise TransportError("constructor broken on purpose")

    monkeypatch.setattr(TcpTransport, "__init__", broken)
    assert markers.backend_unavailable_reason.__wrapped__("tcp") is None


def test_absent_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        markers._BACKEND_PACKAGES, "ucx", ("no_such_module_wt_test", "pip install it")
    )
    reason = markers.backend_unavailable_reason.__wrapped__("ucx")
    assert reason is not None and "'no_such_module_wt_test', not installed" in reason


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        markers.backend_unavailable_reason.__wrapped__("nope")
