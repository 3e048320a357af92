"""`weight-transfer doctor`: every backend gets a verdict with a reason, and it exits 0."""

from __future__ import annotations

import json
from typing import Any

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


def test_ucx_builds_are_reported_with_version_transports_and_rdma_ports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """For ucx and nixl: each UCX build found here, its version and transports (asked in a
    child process, as `ucx_info -d` would list them), which one each backend runs on."""
    from weight_transfer.backends.ucx_native import _builds

    assert main(["doctor", "--json"]) == 0
    ucx = json.loads(capsys.readouterr().out)["ucx"]
    found = {name: _builds.find_build(name) for name in ("wheel", "system", "nixl")}
    assert [b["library"] for b in ucx["builds"]] == [n for n, b in found.items() if b is not None]
    for b in ucx["builds"]:
        assert "error" not in b, b
        assert b["version"].startswith("1.") and "tcp (" in b["transports"]
        assert b["libucp"] == found[b["library"]].libucp  # type: ignore[union-attr]
        assert {"tl", "device", "device_type"} <= set(b["resources"][0])
    assert ucx["ucx_auto"]["library"] in found and ucx["ucx_auto"]["why"]
    if found["nixl"] is not None:
        assert ucx["nixl_ucx"] == found["nixl"].libucp

    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "UCX builds (ucx: option `library`; its default auto takes" in text
    for b in ucx["builds"]:
        assert f"UCX {b['version']} {b['libucp']}" in text
        assert f"transports: {b['transports']}" in text


def test_rdma_devices_a_build_does_not_see_are_named(tmp_path: Any) -> None:
    """Where the kernel lists RDMA devices, a build that sees none of them says so; auto
    says why it chose; a build that cannot load is an error line, not a crash."""
    from weight_transfer.backends.ucx_native import _builds

    info = _builds.doctor_info(rdma=["rxe0"])
    verbs = [b for b in info["builds"] if "ib" in b.get("modules", [])]
    if verbs:
        assert "InfiniBand module" in info["ucx_auto"]["why"]
    lines = "\n".join(cli_doctor._format_ucx(info))
    if not availability.rdma_devices():
        assert "RDMA ports: none of rxe0 (no verbs module, or its libibverbs" in lines
    for name in ("ucm", "ucs", "uct", "ucp"):
        (tmp_path / f"lib{name}.so.0").write_bytes(b"not a library")
    broken = _builds.describe(_builds._build("path", str(tmp_path)))
    assert "error" in broken and "OSError" in broken["error"]
    assert "error: OSError" in "\n".join(
        cli_doctor._format_ucx({"builds": [broken], "ucx_auto": {}, "rdma_devices": []})
    )
