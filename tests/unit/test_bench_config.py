"""`bench transports` settings for two hosts: each side's address and backend options, the
baselines (ib_write_bw among them), what each run received per interface, and the CLI flags
that fill them, each refused with one clear line. No process is started here."""

from __future__ import annotations

from pathlib import Path

import pytest

from weight_transfer.benchmarks import transport_harness as h
from weight_transfer.cli import main

MiB = 1 << 20


def test_role_options_replace_shared_keys_per_side() -> None:
    cfg = h.BenchConfig(
        backends=("nixl", "ibverbs"),
        options=(("nixl", "UCX_TLS", "rc_verbs,ud_verbs,self"), ("nixl", "UCX_NET_DEVICES", "all")),
        receiver_options=(("nixl", "UCX_NET_DEVICES", "rxe0:1"), ("ibverbs", "device", "rxe0")),
        sender_options=(("nixl", "UCX_NET_DEVICES", "rxe1:1"), ("ibverbs", "device", "rxe1")),
    )
    assert cfg.backend_options("nixl", "receiver") == (
        ("UCX_TLS", "rc_verbs,ud_verbs,self"),
        ("UCX_NET_DEVICES", "rxe0:1"),
    )
    assert cfg.backend_options("nixl", "sender") == (
        ("UCX_TLS", "rc_verbs,ud_verbs,self"),
        ("UCX_NET_DEVICES", "rxe1:1"),
    )
    assert cfg.backend_options("ibverbs", "receiver") == (("device", "rxe0"),)
    assert cfg.backend_options("ibverbs", "sender") == (("device", "rxe1"),)
    assert cfg.backend_options("tcp", "sender") == ()
    with pytest.raises(ValueError, match="role must be one of"):
        cfg.backend_options("nixl", "engine")


def test_hosts_default_to_loopback_and_are_per_side() -> None:
    assert (h.BenchConfig().host("receiver"), h.BenchConfig().host("sender")) == (
        "127.0.0.1",
        "127.0.0.1",
    )
    cfg = h.BenchConfig(receiver_host="10.99.0.1", sender_host="10.99.0.2")
    assert (cfg.host("receiver"), cfg.host("sender")) == ("10.99.0.1", "10.99.0.2")


def test_baselines_follow_the_device_and_the_rdma_devices() -> None:
    assert h.BenchConfig().baseline_names == ("socket", "memcpy")
    assert h.BenchConfig(device="cuda").baseline_names == ("peer_copy",)
    cfg = h.BenchConfig(rdma_devices=("rxe0", "rxe1"))
    assert cfg.baseline_names == ("socket", "memcpy", "ib_write_bw")
    assert h.BenchConfig(baselines=(), backends=("tcp",)).baseline_names == ()
    only = h.BenchConfig(baselines=("ib_write_bw",), rdma_devices=("rxe0", "rxe1"))
    assert only.baseline_names == ("ib_write_bw",)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"baselines": ("ib_write_bw",)}, "ib_write_bw baseline needs rdma_devices"),
        ({"baselines": ("iperf",)}, "unknown baseline 'iperf' for device cpu"),
        ({"baselines": ("socket", "socket")}, "baselines repeat a name"),
        ({"device": "cuda", "rdma_devices": ("rxe0", "rxe1")}, "writes host memory"),
        ({"rdma_devices": ("rxe0", "")}, "rdma_devices must be"),
        ({"receiver_host": ""}, "receiver_host must be an address"),
        ({"sender_host": "10.99.0.2 "}, "sender_host must be an address"),
        ({"receiver_options": (("ibverb", "device", "rxe0"),)},
         "receiver option 'device' names unknown backend 'ibverb'"),
        ({"sender_options": (("ucxx", "TLS", "tcp"),)},
         "sender option 'TLS' names unknown backend 'ucxx'"),
        # An explicit empty list wins over the ib_write_bw that rdma_devices would add.
        ({"backends": (), "baselines": (), "rdma_devices": ("rxe0", "rxe1")},
         "nothing to measure"),
    ],
)  # fmt: skip
def test_config_refuses(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        h.BenchConfig(**kwargs)  # type: ignore[arg-type]


def _result() -> h.BenchResult:
    cfg = h.BenchConfig(
        backends=("ibverbs",),
        sizes_bytes=(MiB,),
        rdma_devices=("rxe0", "rxe1"),
        baselines=("socket", "ib_write_bw"),
    )
    result = h.BenchResult(config=cfg, host={})
    result.measurements = [
        h.Measurement("socket", "baseline", MiB, 8, (0.08, 0.04, 0.02)),
        h.Measurement(
            "ib_write_bw",
            "baseline",
            MiB,
            8,
            (0.4, 0.2, 0.1),
            verified=False,
            peak_gbps=(0.1, 0.05, 0.09),
            run_wall_s=(1.5, 1.2, 1.1),
        ),  # fmt: skip
        h.Measurement("ibverbs", "backend", MiB, 8, (0.8, 0.4, 0.2)),
    ]
    result.wire = {"ibverbs": {"net:wtveth0": 9_000_000, "rdma:rxe0/1": 8300}}
    return result


def test_results_carry_min_max_the_ceiling_ratio_and_unverified_tools() -> None:
    result = _result()
    ib = result.get("ib_write_bw", MiB)
    assert ib is not None
    assert (ib.min_gbps, ib.median_gbps, ib.max_gbps) == pytest.approx(
        (8 * MiB / 0.4e9, 8 * MiB / 0.2e9, 8 * MiB / 0.1e9)
    )
    data = result.to_json()
    by_name = {m["name"]: m for m in data["measurements"]}
    assert by_name["ib_write_bw"]["verified"] is False
    assert by_name["ib_write_bw"]["peak_gbps"] == [0.1, 0.05, 0.09]
    assert by_name["ib_write_bw"]["run_wall_s"] == [1.5, 1.2, 1.1]
    assert by_name["ibverbs"]["verified"] is True and "peak_gbps" not in by_name["ibverbs"]
    assert data["config"]["baselines"] == ["socket", "ib_write_bw"]
    assert data["config"]["rdma_devices"] == ["rxe0", "rxe1"]
    assert data["wire"] == {"ibverbs": {"net:wtveth0": 9_000_000, "rdma:rxe0/1": 8300}}
    (row,) = result.ratios()
    assert row["vs_ib_write_bw"] == pytest.approx(0.5) and row["vs_socket"] == pytest.approx(0.1)
    table = h.format_table(result)
    assert "vs ib_write_bw" in table and "min-max GB/s" in table
    assert "not checked bit for bit (a tool's own figures, one run per sample): ib_write_bw" in (
        table
    )
    assert "ibverbs     net:wtveth0 9.0 MB, rdma:rxe0/1 8300 pkts" in table


def _sys(root: Path, counts: dict[str, int], rdma: dict[str, int]) -> tuple[Path, Path]:
    net, ib = root / "net", root / "infiniband"
    for dev, n in counts.items():
        (net / dev / "statistics").mkdir(parents=True, exist_ok=True)
        (net / dev / "statistics" / "rx_bytes").write_text(f"{n}\n")
    for dev, n in rdma.items():
        (ib / dev / "ports" / "1" / "hw_counters").mkdir(parents=True, exist_ok=True)
        (ib / dev / "ports" / "1" / "hw_counters" / "rcvd_pkts").write_text(f"{n}\n")
    return net, ib


def test_wire_counters_and_their_growth(tmp_path: Path) -> None:
    net, ib = _sys(tmp_path, {"lo": 100, "wtveth0": 5000}, {"rxe0": 7})
    before = h.wire_counters(net, ib)
    assert before == {"net:lo": 100, "net:wtveth0": 5000, "rdma:rxe0/1": 7}
    _sys(tmp_path, {"lo": 100, "wtveth0": 9000, "wtveth1": 10}, {"rxe0": 12})
    after = h.wire_counters(net, ib)
    assert h.wire_delta(before, after) == {
        "net:wtveth0": 4000,
        "net:wtveth1": 10,
        "rdma:rxe0/1": 5,
    }
    assert h.wire_counters(tmp_path / "none", tmp_path / "none") == {}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--receiver-option", "ibverbs-device-rxe0"],
         "--receiver-option 'ibverbs-device-rxe0': expected BACKEND:KEY=VALUE"),
        (["--sender-option", "ibverbs:device"],
         "--sender-option 'ibverbs:device': expected BACKEND:KEY=VALUE"),
        (["--sender-option", "ibverb:device=rxe1"],
         "sender option 'device' names unknown backend 'ibverb'"),
        (["--rdma-devices", "rxe0"], "--rdma-devices 'rxe0': expected RECV_DEV,SEND_DEV"),
        (["--rdma-devices", "rxe0,rxe1,rxe2"], "expected RECV_DEV,SEND_DEV"),
        (["--baselines", "ib_write_bw"], "the ib_write_bw baseline needs rdma_devices"),
        (["--baselines", "socket", "--no-baselines"], "--no-baselines and --baselines contradict"),
        (["--receiver-host", ""], "receiver_host must be an address"),
    ],
)  # fmt: skip
def test_cli_refuses_bad_flags_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "transports", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and message in err


def test_cli_fills_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[h.BenchConfig] = []

    def fake_run(config: h.BenchConfig, progress: object) -> h.BenchResult:
        seen.append(config)
        return h.BenchResult(config=config, host={})

    monkeypatch.setattr(h, "run_benchmarks", fake_run)
    code = main(
        [
            "bench", "transports", "--backends", "ibverbs,nixl", "--sizes", "1MiB",
            "--receiver-host", "10.99.0.1", "--sender-host", "10.99.0.2",
            "--option", "nixl:UCX_TLS=rc_verbs,ud_verbs,self",
            "--receiver-option", "nixl:UCX_NET_DEVICES=rxe0:1",
            "--sender-option", "nixl:UCX_NET_DEVICES=rxe1:1",
            "--receiver-option", "ibverbs:device=rxe0", "--sender-option", "ibverbs:device=rxe1",
            "--rdma-devices", "rxe0,rxe1",
        ]
    )  # fmt: skip
    assert code == 0
    (cfg,) = seen
    assert (cfg.receiver_host, cfg.sender_host) == ("10.99.0.1", "10.99.0.2")
    assert cfg.rdma_devices == ("rxe0", "rxe1")
    assert cfg.baseline_names == ("socket", "memcpy", "ib_write_bw")
    assert cfg.backend_options("nixl", "receiver") == (
        ("UCX_TLS", "rc_verbs,ud_verbs,self"),
        ("UCX_NET_DEVICES", "rxe0:1"),
    )
    assert cfg.backend_options("ibverbs", "sender") == (("device", "rxe1"),)
