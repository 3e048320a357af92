"""The ib_write_bw baseline's pieces: perftest's output parsed (real output captured from two rxe
devices in the Soft-RoCE VM, tests/fixtures/perftest/), the GID chosen from a sysfs GID table,
and the server/client pair driven with a timeout on every wait."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from weight_transfer.benchmarks import perftest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "perftest"
MiB = 1 << 20


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_parses_client_output_in_mib_per_second() -> None:
    report = perftest.parse_ib_write_bw(fixture("ib_write_bw_client_64KiB_mib.txt"))
    assert report.size_bytes == 65536 and report.iterations == 200
    # "BW peak[MB/sec] 31.89, BW average[MB/sec] 25.39": perftest's MB are MiB.
    assert report.peak_bytes_per_s == pytest.approx(31.89 * MiB)
    assert report.average_bytes_per_s == pytest.approx(25.39 * MiB)


def test_parses_server_output_and_a_single_large_write_run() -> None:
    server = perftest.parse_ib_write_bw(fixture("ib_write_bw_server_64KiB_mib.txt"))
    assert server.average_bytes_per_s == pytest.approx(25.39 * MiB)
    big = perftest.parse_ib_write_bw(fixture("ib_write_bw_client_16MiB_mib.txt"))
    assert (big.size_bytes, big.iterations) == (16 * MiB, 5)
    assert big.average_bytes_per_s == pytest.approx(24.22 * MiB)


def test_parses_gigabits_per_second() -> None:
    report = perftest.parse_ib_write_bw(fixture("ib_write_bw_client_1MiB_gbits.txt"))
    assert (report.size_bytes, report.iterations) == (MiB, 8)
    assert report.average_bytes_per_s == pytest.approx(0.26e9 / 8)
    assert report.peak_bytes_per_s == pytest.approx(0.26e9 / 8)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        # What perftest prints when it refuses to run (captured in the VM).
        (" Iteration num should be between 5 and 100000000\n Parser function exited with Error\n",
         "no results row; its last line: 'Parser function exited with Error'"),
        ("IB device rxe7 not found\n Unable to find the Infiniband/RoCE device\n",
         "Unable to find the Infiniband/RoCE device"),
        ("", r"\(no output\)"),
        (" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n",
         "not a result"),
        (" #bytes     #iterations    BW peak[KB/sec]    BW average[KB/sec]   MsgRate[Mpps]\n"
         " 65536      200              31.89              25.39     0.000406\n", "unknown"),
    ],
)  # fmt: skip
def test_refuses_output_without_a_result(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        perftest.parse_ib_write_bw(text)


def test_iterations_cover_the_sample_and_perftests_minimum() -> None:
    assert perftest.ib_write_bw_iterations(64 * 1024, 8 * MiB) == 128
    assert perftest.ib_write_bw_iterations(3000, 10000) == 5  # 4 would do; perftest wants 5
    assert perftest.ib_write_bw_iterations(16 * MiB, 8 * MiB) == 5


def _fake_port(sysfs: Path, device: str, link_layer: str, gids: dict[int, tuple[str, str]]) -> None:
    """A sysfs port with a 16-entry GID table; entries not in `gids` are zero, and reading
    their type fails as the kernel's does (EINVAL), here simulated by a missing file."""
    root = sysfs / device / "ports" / "1"
    (root / "gids").mkdir(parents=True)
    (root / "gid_attrs" / "types").mkdir(parents=True)
    (root / "link_layer").write_text(link_layer + "\n")
    for i in range(16):
        gid, kind = gids.get(i, ("0000:0000:0000:0000:0000:0000:0000:0000", ""))
        (root / "gids" / str(i)).write_text(gid + "\n")
        if kind:
            (root / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")


RXE0 = {  # rxe0 in the VM: link-local v2 at 0, 10.99.0.1 (v2) at 1
    0: ("fe80:0000:0000:0000:8c99:b5ff:feb2:0d27", "RoCE v2"),
    1: ("0000:0000:0000:0000:0000:ffff:0a63:0001", "RoCE v2"),
}


def test_gid_index_of_the_rxe_devices_address(tmp_path: Path) -> None:
    _fake_port(tmp_path, "rxe0", "Ethernet", RXE0)
    assert perftest.roce_gid_index("rxe0", address="10.99.0.1", sysfs=tmp_path) == 1
    # No address of its own (loopback run): the ibverbs backend's rule, IPv4 RoCE v2 first.
    assert perftest.roce_gid_index("rxe0", address="127.0.0.1", sysfs=tmp_path) == 1


def test_gid_index_prefers_the_sides_own_address(tmp_path: Path) -> None:
    two = dict(RXE0)
    two[2] = ("0000:0000:0000:0000:0000:ffff:0a63:0005", "IB/RoCE v1")
    two[3] = ("0000:0000:0000:0000:0000:ffff:0a63:0005", "RoCE v2")
    _fake_port(tmp_path, "rxe0", "Ethernet", two)
    assert perftest.roce_gid_index("rxe0", address="10.99.0.5", sysfs=tmp_path) == 3
    assert perftest.roce_gid_index("rxe0", address="10.99.0.1", sysfs=tmp_path) == 1


def test_gid_index_refuses_an_empty_table(tmp_path: Path) -> None:
    _fake_port(tmp_path, "rxe0", "Ethernet", {})
    with pytest.raises(ValueError, match="GID table is empty"):
        perftest.roce_gid_index("rxe0", sysfs=tmp_path)
    with pytest.raises(ValueError, match="cannot read its GID table"):
        perftest.roce_gid_index("mlx5_9", sysfs=tmp_path)


# A stand-in for ib_write_bw on PATH, to drive the pair's process handling (the server's
# listening socket, the client's connection, exits and hangs) without an RDMA device. It prints
# the captured client output with the size and iterations it was given.
FAKE = r"""#!PYTHON
import os, socket, sys, time
args = sys.argv[1:]
opt = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("-")}
mode = os.environ.get("FAKE_PERFTEST", "ok")
server = "--source_ip" not in args
row = " %s    %s   31.89   25.39   0.000406\n" % (opt["-s"], opt["-n"])
header = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
if server:
    if mode == "server-dies":
        print(" Unable to find the Infiniband/RoCE device"); sys.exit(1)
    s = socket.create_server(("127.0.0.1", int(opt["-p"])))
    s.settimeout(30)
    c, _ = s.accept()
    c.recv(1)
    print(header + row)
else:
    c = socket.create_connection((args[-1], int(opt["-p"])), source_address=(opt["--source_ip"], 0))
    if mode == "client-hangs":
        time.sleep(60)
    if mode == "wrong-size":
        row = " 4096    %s   31.89   25.39   0.000406\n" % opt["-n"]
    c.sendall(b"x")
    print(header + row)
"""


@pytest.fixture
def fake_perftest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "bin" / perftest.EXECUTABLE
    exe.parent.mkdir()
    exe.write_text(FAKE.replace("PYTHON", sys.executable, 1))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    return exe


SERVER = perftest.RdmaSide(device="rxe0", gid_index=1, host="127.0.0.1")
CLIENT = perftest.RdmaSide(device="rxe1", gid_index=1, host="127.0.0.1")


def _run(timeout_s: float = 30.0) -> perftest.IbWriteBwRun:
    return perftest.run_ib_write_bw(
        server=SERVER, client=CLIENT, size_bytes=65536, iterations=128, timeout_s=timeout_s
    )


def test_pair_runs_server_then_client(fake_perftest: Path) -> None:
    run = _run()
    assert (run.report.size_bytes, run.report.iterations) == (65536, 128)
    assert run.report.average_bytes_per_s == pytest.approx(25.39 * MiB)
    assert run.wall_s > 0


def test_pair_reports_a_server_that_exits_first(
    fake_perftest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PERFTEST", "server-dies")
    with pytest.raises(RuntimeError, match="server exited with 1 before listening: Unable to"):
        _run()


def test_pair_times_out_on_a_hung_client(
    fake_perftest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PERFTEST", "client-hangs")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="client did not finish within 2"):
        _run(timeout_s=2.0)
    assert time.monotonic() - start < 10


def test_pair_refuses_a_report_of_another_run(
    fake_perftest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PERFTEST", "wrong-size")
    with pytest.raises(RuntimeError, match="reported 4096 B x 128, not what it was asked for"):
        _run()


def test_unavailable_reasons(
    tmp_path: Path, fake_perftest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_port(tmp_path / "ib", "rxe0", "Ethernet", RXE0)
    reason = perftest.unavailable_reason(("rxe0", "rxe1"), sysfs=tmp_path / "ib")
    assert reason == f"RDMA device rxe1 absent ({tmp_path / 'ib'} lists rxe0)"
    assert perftest.unavailable_reason(("rxe0", "rxe0"), sysfs=tmp_path / "ib") is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    reason = perftest.unavailable_reason(("rxe0", "rxe0"), sysfs=tmp_path / "ib")
    assert reason is not None and "ib_write_bw is not on PATH" in reason
