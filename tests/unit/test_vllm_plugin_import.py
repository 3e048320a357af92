"""The vLLM plug-in is found through its entry point, and importing the project never imports
vLLM."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from tests.markers import requires_module


def test_import_never_imports_vllm() -> None:
    code = (
        "import sys, weight_transfer, weight_transfer.engines, weight_transfer.engines.vllm, "
        "weight_transfer.cli.bench, weight_transfer.cli.demo, weight_transfer.cli.demo_vllm, "
        "weight_transfer.cli.doctor, weight_transfer.cli.plan; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    )
    run = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_entry_point_names_the_register_function() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("weight_transfer") == "weight_transfer.engines.vllm.worker:register"


@requires_module("vllm")
def test_plugin_classes_fit_the_installed_vllm() -> None:
    """benchmarks/probes/vllm_interface_check.py against the installed vLLM (docs/vllm.md says
    which other releases it was run against, from their wheels)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks/probes/vllm_interface_check.py"
    run = subprocess.run([sys.executable, str(script)], timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [ln for ln in run.stdout.splitlines() if ln.startswith("ok ")] == [
        "ok 1: register() put both engines in vLLM's factories",
        "ok 2: the worker engine implements every abstract method of this vLLM's base class",
        "ok 3a: the factory's trainer_init call reached vLLM's first phase through ours",
        "ok 3b: the trainer engine's constructor takes this vLLM's base-class arguments",
    ]
