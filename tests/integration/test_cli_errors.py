"""Bad input to the CLI: one clear line naming the problem, exit code 2, within seconds, before
any process starts; and the control plane's waits that used to hang or wait out their timeout."""

from __future__ import annotations

import builtins
import importlib.util
import multiprocessing
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from weight_transfer.cli import bench as cli_bench
from weight_transfer.cli import main
from weight_transfer.cli import run_demo as demo
from weight_transfer.config import (
    ControllerConfig,
    ControlPlaneConfig,
    config_from_mapping,
    load_toml,
)
from weight_transfer.control import ControlPlane
from weight_transfer.controller import Controller
from weight_transfer.errors import ControlPlaneAuthError, TransportTimeoutError

TOKEN = "0123456789abcdef0123456789abcdef"


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI in this process; assert exit 2, no process started, one error line."""
    started: list[Any] = []
    spawned = multiprocessing.get_context("spawn").Process  # what weight_transfer.cli.launch starts
    real_start = spawned.start

    def no_start(self: Any) -> None:  # pragma: no cover - only reached on a regression
        started.append(self)
        real_start(self)

    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spawned, "start", no_start)
        code = main(argv)
    elapsed = time.monotonic() - t0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, out, err)
    assert not started, "a process was started before the input was checked"
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out == ""
    assert elapsed < 20, elapsed
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--model", "no-such-model"], "unknown model shape 'no-such-model'; known: "),
        (["demo", "--model", "tiny-moe"], "is a MoE shape"),
        (["demo", "--engine-ranks", "3"], "--engine-ranks 3: cannot shard 'tiny'"),
        (["demo", "--steps", "0"], "steps must be >= 1"),
    ],
)
def test_demo_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert needle in _one_line_error(capsys, argv)


def test_demo_missing_backend_package(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "nixl_cu13":
            raise ImportError("No module named 'nixl_cu13'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    line = _one_line_error(capsys, ["demo", "--backend", "nixl"])
    assert "--backend nixl" in line and "pip install nixl-cu13==1.5.1" in line
    assert "weight-transfer[" not in line  # not a name on PyPI


def test_demo_missing_transformers_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
    )
    line = _one_line_error(capsys, ["demo"])
    assert "pip install 'transformers>=4.45'" in line


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('[control]\nport = "29700"\n', "config.control.port: expected an integer, got str"),
        ("[control]\ntoken = 12345\n", "config.control.token: expected a string, got int"),
        ('[planner]\nmemory_budget_bytes = "1GiB"\n', "config.planner.memory_budget_bytes"),
        ("[planner]\nmemory_budget_bytes = 1.5e9\n", "expected an integer, got float"),
        ("[sender]\nmemory_budget_bytes = 1\n", "config.sender: unknown setting"),
        ("[planer]\nmemory_budget_bytes = 1\n", "config: unknown table [planer]"),
        ('[control]\ntoken = "xOsNmkg5xHsBzlmZY7kjnbNV9YnevoHswB73Axu9t-8"\n', "sample printed"),
        ('transport = "tcp"\n[transport_options]\nUCX_TLS = ""\n', "option 'UCX_TLS' is empty"),
        ("[control]\nport = true\n", "config.control.port: expected an integer, got bool"),
        ("[sender]\nbudget = 1\n", "config.sender: unknown setting 'budget'"),
        ('transport = "tcp"\n[transport_options]\nfooo = 1\n', "tcp: unknown option(s) 'fooo'"),
        ('transport = "loopback"\n[transport_options]\nx = 1\n', "loopback: unknown option(s)"),
        ('transport = "ucx"\n[transport_options]\nNO_SUCH_VAR = 1\n', "NO_SUCH_VAR"),
        (
            'transport = "ucx"\n[transport_options]\nTLS = "no_tl"\n',
            "UCX_TLS lane 'no_tl' is not available",
        ),
    ],
)
def test_demo_bad_config_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, toml: str, needle: str
) -> None:
    if "ucx" in toml and importlib.util.find_spec("libucx") is None:
        pytest.skip("libucx-cu13 is not installed")
    path = tmp_path / "wt.toml"
    path.write_text(toml)
    assert needle in _one_line_error(capsys, ["demo", "--config", str(path)])


def test_demo_with_a_busy_control_port_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A control port another program holds used to end the demo after every process had
    started (32 s, a 40-line traceback, reported as a timeout); now one line, exit 2."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path = tmp_path / "wt.toml"
        path.write_text(f"[control]\nport = {port}\n")
        line = _one_line_error(capsys, ["demo", "--config", str(path)])
    assert f"control port {port} on 127.0.0.1 is in use" in line, line


def test_bench_update_without_gpus_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs")
    line = _one_line_error(capsys, ["bench", "update", "--preset", "llama-3.1-8b"])
    assert "needs 2 CUDA GPU(s)" in line and "this host has" in line


def test_bench_update_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "update", "--preset", "nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "llama-3.1-8b" in err


def test_bench_transports_plot_without_matplotlib(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        cli_bench.importlib.util,
        "find_spec",
        lambda n, *a: None if n == "matplotlib" else real(n, *a),
    )
    line = _one_line_error(capsys, ["bench", "transports", "--plot", "x.png"])
    assert "pip install 'matplotlib>=3.7'" in line


def test_demo_backend_flag_conflicting_with_the_config_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "wt.toml"
    path.write_text('transport = "tcp"\n')
    line = _one_line_error(capsys, ["demo", "--config", str(path), "--backend", "loopback"])
    assert "--backend loopback conflicts with transport = 'tcp'" in line and str(path) in line


def test_demo_that_does_not_fit_in_memory_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The 8B preset needs far more than this host has: refused before any process starts,
    saying how much it needs and that presets are shapes with random weights."""
    from weight_transfer.cli.demo_memory import available_bytes, estimate

    need = estimate(demo.DemoConfig(model="llama-3.1-8b")).total_bytes
    have = available_bytes()
    if have is None or have >= need:
        pytest.skip(f"this host has {have} bytes available, the 8B demo needs about {need}")
    line = _one_line_error(capsys, ["demo", "--model", "llama-3.1-8b"])
    assert "--model llama-3.1-8b" in line and "GiB of memory on this host" in line, line
    assert "random weights" in line, line


def test_demo_memory_estimate_counts_every_process() -> None:
    from weight_transfer.cli import demo_memory
    from weight_transfer.planner.presets.models import get_model_shape, num_parameters

    cfg = demo.DemoConfig(model="llama-3.1-8b")
    parts = dict(demo_memory.estimate(cfg).parts)
    params = num_parameters(get_model_shape("llama-3.1-8b"))
    # Every trainer rank builds the model in float32 before it casts and shards it.
    assert parts["trainer ranks: model, gradients, AdamW states, verification copies"] >= (
        cfg.train_ranks * 4 * params
    )
    assert parts["trainer ranks: transfer memory budget"] == 3 * (256 << 20)
    assert demo_memory.memory_problem(cfg, available=1 << 60) is None
    small = demo_memory.memory_problem(demo.DemoConfig(), available=1 << 20)
    assert small is not None and "--model tiny" in small


def test_help_shows_defaults_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["demo", "--help"], ["bench", "update", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "(default: " in out, argv
        assert "llama-3.1-8b" in out, argv


def test_config_repr_hides_the_token() -> None:
    cfg = config_from_mapping({"control": {"token": TOKEN}})
    assert TOKEN not in repr(cfg) and TOKEN not in repr(cfg.control)


def test_readme_toml_example_builds_a_transport_on_this_host(tmp_path: Path) -> None:
    """The TOML example of docs/configuration.md is refused for its published sample token; with
    a token of one's own it loads and its transport options work on a CPU host."""
    import re

    from weight_transfer.config import new_token

    readme = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    start = readme.index("```toml\n") + len("```toml\n")
    text = readme[start : readme.index("```", start)]
    path = tmp_path / "example.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="sample printed in this project's docs"):
        load_toml(path)
    path.write_text(re.sub(r'token = "[^"]+"', f'token = "{new_token()}"', text))
    cfg = load_toml(path)
    assert cfg.num_engines == 2 and cfg.planner.memory_budget_bytes == 1 << 30
    from weight_transfer.backends.base import create_transport

    create_transport(cfg.transport_config()).close()


def test_connecting_to_a_port_that_is_not_a_store_times_out() -> None:
    """Something accepts on the port but never speaks TCPStore: the join gives up in time."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(srv.accept()[0]), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(TransportTimeoutError, match=rf"engine0: could not reach .*:{port}"):
        ControlPlane(
            ControlPlaneConfig(port=port, token=TOKEN, timeout_s=2.0),
            server=False,
            member="engine0",
        )
    assert time.monotonic() - t0 < 6
    srv.close()


def test_token_mismatch_is_reported_by_the_controller_at_once() -> None:
    port = demo.free_port()
    good = ControlPlaneConfig(port=port, token=TOKEN, timeout_s=30.0)
    controller = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), good)
    try:
        bad = ControlPlaneConfig(port=port, token=secrets.token_hex(16), timeout_s=30.0)
        with pytest.raises(ControlPlaneAuthError):
            ControlPlane(bad, server=False, member="engine0")
        t0 = time.monotonic()
        with pytest.raises(ControlPlaneAuthError, match="another token"):
            controller._wait_for_engines(1)
        assert time.monotonic() - t0 < 3
    finally:
        controller.close()


def test_doctor_json_is_clean_json() -> None:
    """NIXL's log lines go to stderr: stdout is one JSON document."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from weight_transfer.cli import main; raise SystemExit(main(['doctor', '--json']))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    import json

    report = json.loads(proc.stdout)
    # Which delta kernels would run: on a machine without a GPU, torch ops on the CPU.
    if not report["cuda_available"]:
        assert report["delta_kernels"].startswith("torch ops on the CPU"), report["delta_kernels"]


def test_plan_units_and_inline_rates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "kimi-k2-mini"]) == 0
    out, err = capsys.readouterr()
    assert "0.00 GB" not in out and " MB" in out
    assert err.count("kimi-k2-mini:") == 1  # the preset's name once, not repeated
    assert main(["simulate", "--preset", "kimi-k2-mini", "--rates", '{"nic_gb_per_s": 40}']) == 0
    assert "NIC 1 x 40 GB/s" in capsys.readouterr().out
    _one_line_error(capsys, ["simulate", "--preset", "kimi-k2-mini", "--rates", '{"nic": 1}'])


def test_demo_config_control_table_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`demo --config` takes the file's [control], [planner], [sender] and [receiver] tables
    (it ignored them)."""
    seen: list[demo.DemoConfig] = []

    def fake_run(cfg: demo.DemoConfig, **_: Any) -> demo.DemoResult:
        seen.append(cfg)
        return demo.DemoResult(
            updates=[],
            exit_codes={},
            errors=["stopped by the test"],
            engine_tensors={},
            expected={},
        )

    monkeypatch.setattr(demo, "run_demo", fake_run)
    path = tmp_path / "wt.toml"
    path.write_text(
        f'transport = "tcp"\n[control]\nport = 29711\ntoken = "{TOKEN}"\n'
        "[planner]\nmemory_budget_bytes = 33554432\n[sender]\nupdate_timeout_s = 7.5\n"
        "[receiver]\nallow_unwritten = true\n"
    )
    assert main(["demo", "--config", str(path)]) == 1
    capsys.readouterr()
    (cfg,) = seen
    assert (cfg.backend, cfg.control_port, cfg.control_token) == ("tcp", 29711, TOKEN)
    assert cfg.control_host == "127.0.0.1"
    # [planner], [sender] and [receiver] reach every process's config (they were ignored).
    tc = demo.transfer_config(cfg, cfg.control_port, cfg.control_token)
    assert tc.planner.memory_budget_bytes == 32 << 20
    assert tc.sender.update_timeout_s == 7.5 and tc.receiver.allow_unwritten
