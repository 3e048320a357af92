"""Skips come from `weight_transfer.backends.availability`, for an absent package or absent
hardware only, never for a failure; and `weight-transfer doctor` says the same thing."""

from __future__ import annotations

import pytest

from tests import markers
from weight_transfer.backends import availability
from weight_transfer.backends.base import BACKENDS, TransportError
from weight_transfer.backends.tcp import TcpTransport
from weight_transfer.cli import doctor


def test_broken_constructor_is_not_a_reason_to_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, *args: object, **kwargs: object) -> None:
        raise TransportError("constructor broken on purpose")

    monkeypatch.setattr(TcpTransport, "__init__", broken)
    assert availability.backend_unavailable_reason("tcp") is None
    # The doctor does construct it, and reports the failure as its own (not as a skip reason).
    assert doctor._status("tcp", 0).host_reason == "constructor broken on purpose"


def test_absent_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(availability.BACKEND_MODULES, "ucx", "no_such_module_wt_test")
    reason = availability.backend_unavailable_reason("ucx")
    assert reason is not None and "'no_such_module_wt_test', not installed" in reason
    # How to install it: the package PyPI has (weight-transfer itself is not on PyPI).
    assert "pip install 'libucx-cu13>=1.22,<1.23'" in reason


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        availability.backend_unavailable_reason("nope")


def test_markers_are_thin_users_of_availability() -> None:
    assert markers.backend_unavailable_reason.__wrapped__ is availability.backend_unavailable_reason
    for mark, reason in (
        (markers.requires_cuda, availability.cuda_unavailable_reason()),
        (markers.requires_rdma_device, availability.rdma_unavailable_reason()),
        (markers.requires_gpus(3), availability.gpus_missing_reason(3)),
        (markers.requires_module("no_such_module_wt_test"), "needs Python module"),
    ):
        skips = mark.args[0]
        assert skips == (reason is not None), mark
        if skips:
            assert mark.kwargs["reason"].startswith(reason), (mark.kwargs, reason)
    assert not markers.requires_module("msgpack").args[0]


@pytest.mark.parametrize("missing", [False, True], ids=["this host", "package removed"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_doctor_and_markers_agree(
    backend: str, missing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a test would skip, the doctor says "no" with the same reason; where the doctor
    says a backend works on host memory, its tests run."""
    if missing:
        monkeypatch.setitem(availability.BACKEND_MODULES, backend, "no_such_module_wt_test")
    skip_reason = markers.backend_unavailable_reason.__wrapped__(backend)  # uncached
    status = doctor._status(backend, availability.num_cuda_gpus())
    if skip_reason is not None:
        assert not status.host_ok and status.host_reason == skip_reason
    else:  # nothing missing: the doctor's verdict is the constructor's
        assert status.host_ok or status.host_reason == doctor._try_construct(backend, None)
    if status.host_ok:
        assert skip_reason is None
    if availability.num_cuda_gpus() == 0:
        assert not status.gpu_ok and status.gpu_reason == availability.cuda_unavailable_reason()
        assert markers.requires_cuda.kwargs["reason"] == status.gpu_reason
    assert missing <= (skip_reason is not None)


def test_rdma_tests_live_where_the_vm_run_collects_them() -> None:
    """tests/softroce/run (CI's VM step) collects only tests/conformance and
    tests/integration/test_rdma.py; an rdma test anywhere else would never run."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    allowed = {root / "integration" / "test_rdma.py", Path(__file__).resolve()}
    for path in root.rglob("*.py"):
        if path in allowed or (root / "conformance") in path.parents:
            continue
        assert "pytest.mark." + "rdma" not in path.read_text(), path
    assert (
        "tests/conformance tests/integration/test_rdma.py"
        in (root / "softroce" / "run").read_text()
    )
