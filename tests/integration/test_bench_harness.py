"""The transport benchmark harness at tiny sizes: it runs, verifies the data, and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weight_transfer.benchmarks import transport_harness as h
from weight_transfer.cli import main

KiB = 1024


def test_parse_and_format_sizes() -> None:
    assert h.parse_size("4KiB") == 4096
    assert h.parse_size("64K") == 65536
    assert h.parse_size("1MiB") == 1 << 20
    assert h.parse_size("256MiB") == 256 << 20
    assert h.parse_size("1GiB") == 1 << 30
    assert h.parse_size("4096") == 4096
    for bad in ("", "0", "4 parsecs", "-1MiB"):
        with pytest.raises(ValueError):
            h.parse_size(bad)
    assert [h.format_size(n) for n in (4096, 1 << 20, 3 << 30, 1000)] == [
        "4KiB",
        "1MiB",
        "3GiB",
        "1000B",
    ]


def test_percentile_and_plan() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert h.percentile(values, 50) == 3.0
    assert h.percentile(values, 10) == pytest.approx(1.4)
    assert h.percentile(values, 90) == pytest.approx(4.6)
    assert h.sample_plan(4 * KiB, 1 << 20) == (4 * KiB, 256)
    assert h.sample_plan(3 << 20, 1 << 20) == (3 << 20, 1)
    assert h.sample_plan(3000, 10000) == (3000, 4)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        h.BenchConfig(backends=("carrier-pigeon",))
    with pytest.raises(ValueError, match="device"):
        h.BenchConfig(device="tpu")
    with pytest.raises(ValueError, match="rounds"):
        h.BenchConfig(rounds=0)
    with pytest.raises(ValueError, match="positive"):
        h.BenchConfig(sizes_bytes=(0,))
    with pytest.raises(ValueError, match="repeat"):
        h.BenchConfig(backends=("tcp", "tcp"))


def test_verify_bytes_catches_one_wrong_byte() -> None:
    data = h.seeded_bytes(10_000, 7)
    assert torch.equal(data, h.seeded_bytes(10_000, 7))
    assert not torch.equal(data, h.seeded_bytes(10_000, 8))
    assert h.verify_bytes(data, 7) == "ok"
    data[4321] ^= 1
    verdict = h.verify_bytes(data, 7)
    assert verdict.startswith("mismatch: 1 of 10000 bytes differ, first at offset 4321")


def test_receiver_check_fails_when_nothing_was_written() -> None:
    """The end-to-end check is real: an unwritten target does not pass."""
    with h.ReceiverProcess("loopback", "cpu", (), 64 * KiB, init_seed=1, timeout_s=60) as rx:
        assert rx.check(64 * KiB, 2).startswith("mismatch")
        assert rx.check(64 * KiB, 1) == "ok"  # its own initial bytes
        assert rx.stop() == []


def test_run_loopback_and_tcp(tmp_path: Path) -> None:
    cfg = h.BenchConfig(
        backends=("loopback", "tcp"),
        sizes_bytes=(4 * KiB, 64 * KiB),
        warmup_rounds=1,
        rounds=3,
        min_sample_bytes=256 * KiB,
        timeout_s=60,
    )
    lines: list[str] = []
    result = h.run_benchmarks(cfg, progress=lines.append)
    assert result.errors == {} and result.skipped == {}
    names = {"socket", "memcpy", "loopback", "tcp"}
    assert {(m.name, m.size_bytes) for m in result.measurements} == {
        (n, s) for n in names for s in cfg.sizes_bytes
    }
    assert len(lines) == len(result.measurements)
    for m in result.measurements:
        assert len(m.samples_s) == 3 and all(t > 0 for t in m.samples_s)
        assert m.sample_bytes == 256 * KiB
        assert 0 < m.p10_gbps <= m.median_gbps <= m.p90_gbps
    ratios = result.ratios()
    assert len(ratios) == 4
    for r in ratios:
        m = result.get(r["name"], r["size_bytes"])
        sock = result.get("socket", r["size_bytes"])
        assert m is not None and sock is not None
        assert r["vs_socket"] == pytest.approx(m.median_gbps / sock.median_gbps)
    table = h.format_table(result)
    assert "vs socket" in table and "vs memcpy" in table and "tcp" in table

    json_path, png_path = tmp_path / "r.json", tmp_path / "r.png"
    h.write_json(result, json_path)
    data = json.loads(json_path.read_text())
    assert data["schema"] == h.SCHEMA
    assert all(m["verified"] for m in data["measurements"])
    assert data["config"]["sizes_bytes"] == [4 * KiB, 64 * KiB]
    h.plot_result(result, png_path)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_axis_turns_logarithmic_when_lines_span_more_than_ten_times() -> None:
    """The plot's linear y axis squashed tcp (~0.1 GB/s) flat against a memcpy baseline
    (~10 GB/s); values that span more than 10x now get a log axis."""
    assert h.throughput_axis_scale([0.1, 0.5, 10.0]) == "log"
    assert h.throughput_axis_scale([2.0, 5.0, 19.0]) == "linear"
    assert h.throughput_axis_scale([0.0, 3.0]) == "linear"
    assert h.throughput_axis_scale([]) == "linear"


def test_cli_bench_transports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path, png_path = tmp_path / "b.json", tmp_path / "b.png"
    code = main(
        [
            "bench", "transports", "--backends", "loopback", "--sizes", "16KiB",
            "--rounds", "2", "--warmup-rounds", "0", "--min-sample-bytes", "64KiB",
            "--json", str(json_path), "--plot", str(png_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "loopback" in out.out and "16KiB" in out.out
    assert "median" in out.err  # one progress line per measurement
    data = json.loads(json_path.read_text())
    assert {m["name"] for m in data["measurements"]} == {"socket", "memcpy", "loopback"}
    assert png_path.stat().st_size > 0


def test_cli_bench_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transports", "--sizes", "4 parsecs"]) == 2
    assert "cannot parse size" in capsys.readouterr().err
    assert main(["bench", "transports", "--option", "ucx-no-colon"]) == 2
    assert "BACKEND:KEY=VALUE" in capsys.readouterr().err
