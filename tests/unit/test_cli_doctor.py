"""`weight-transfer doctor`: every backend gets a verdict with a reason, and it exits 0."""

from __future__ import annotations

import json

import pytest
import torch

from weight_transfer.backends import availability
from weight_transfer.backends.base import BACKENDS, TransportUnavailableError
from weight_transfer.cli import doctor as cli_doctor
from weight_transfer.cli import main


def test_report_covers_every_backend_with_reasons() -> None:
    report = cli_doctor.collect_report()
    assert [b.name for b in report.backends] == list(BACKENDS)
    by_name = {b.name: b for b in report.backends}
    # loopback and tcp need nothing beyond the project's dependencies.
    assert by_name["loopback"].host_ok and by_name["loopback"].host_reason is None
    assert by_name["tcp"].host_ok
    for b in report.backends:
        assert b.host_ok == (b.host_reason is None)
        assert b.gpu_ok == (b.gpu_reason is None)
        if not torch.cuda.is_available():
            assert not b.gpu_ok and b.gpu_reason == availability.cuda_unavailable_reason()
    ib = by_name["ibverbs"]
    if not report.rdma_devices:
        assert not ib.host_ok
        assert ib.host_reason is not None
        assert "needs an RDMA device" in ib.host_reason or "an RDMA device" in ib.host_reason


def test_missing_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_doctor, "_version", lambda dist: None)
    monkeypatch.setattr(
        availability, "module_installed", lambda name: name != availability.BACKEND_MODULES["ucx"]
    )
    status = cli_doctor._status("ucx", 0)
    assert not status.host_ok
    assert status.host_reason is not None
    assert "needs Python module 'libucx', not installed" in status.host_reason
    assert "pip install 'libucx-cu13>=1.22,<1.23'" in status.host_reason
    assert status.packages == {"libucx-cu13": None}


def test_construction_error_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str) -> type:
        raise TransportUnavailableError(f"transport {name!r} could not start: no lanes\nmore")

    monkeypatch.setattr(cli_doctor, "load_backend", refuse)
    status = cli_doctor._status("tcp", 0)
    assert not status.host_ok
    assert status.host_reason == "transport 'tcp' could not start: no lanes"


def test_no_rdma_device_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(availability, "module_installed", lambda name: True)  # pyverbs present
    monkeypatch.setattr(availability, "rdma_devices", lambda: [])
    status = cli_doctor._status("ibverbs", 0)
    assert status.host_reason == (
        f"backend 'ibverbs' needs an RDMA device ({availability.RDMA_SYSFS} lists none)"
    )
    assert not status.gpu_ok


def test_cli_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    for name in BACKENDS:
        assert name in text
    assert "can run here:" in text and "loopback" in text.split("can run here:")[1]
    assert f"torch {torch.__version__}" in text

    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"] == torch.__version__
    assert {b["name"] for b in data["backends"]} == set(BACKENDS)
    assert "num_devices" in data["ibverbs"]
