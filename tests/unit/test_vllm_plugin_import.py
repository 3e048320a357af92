"""The vLLM plug-in is found through its entry point, and importing the project never imports
vLLM."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_import_never_imports_vllm() -> None:
    code = (
        "import sys, weight_transfer, weight_transfer.engines, weight_transfer.vllm, "
        "weight_transfer.cli.bench, weight_transfer.cli.demo, weight_transfer.cli.demo_vllm, "
        "weight_transfer.cli.doctor, weight_transfer.cli.plan; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    )
    run = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_entry_point_names_the_register_function() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("weight_transfer") == "weight_transfer.engines.vllm:register"
