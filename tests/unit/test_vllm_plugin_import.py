"""The vLLM plug-in is found through its entry point, and importing the project never imports vLLM."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_import_never_imports_vllm() -> None:
    code = (
        "import sys, weight_transfer, weight_transfer.transfer.engines, "
        "weight_transfer.transfer.engines.vllm_protocol, weight_transfer.transfer.cli_commands; "
        "sys.exit(1 if 'vllm' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_entry_point_names_the_register_function() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("weight_transfer") == "weight_transfer.transfer.engines.vllm:register"
