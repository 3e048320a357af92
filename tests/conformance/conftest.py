"""Fixtures of the conformance suite: `backend` runs each test on every case that can run here.

One UCX build per process (`backends.ucx_native._libucp.load`): the ucx cases that load a
different build than this pytest process (`ucx` takes the wheel here, `ucx-system` the
distribution's UCX) run in a child pytest of their own, one per build, started before the first
test; their items here then report the child's outcome (pass, skip with its reason, or the
failure text) instead of running. Which build this process keeps: the one it already loaded,
else the build of the first selected ucx case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import pytest

from tests.conformance._support import BACKEND_NAMES, case, make_transport
from tests.markers import backend_unavailable_reason, requires_rdma_device
from weight_transfer.backends import availability
from weight_transfer.backends.base import Transport

_CHILD_REPORT_ENV = "WT_CONFORMANCE_CHILD_REPORT"
"""Set in a child pytest: where its report plugin (`_child_report`) writes each item's outcome."""
_DELEGATED = pytest.StashKey[str]()
"""On an item that a child runs: the libucp path of its build."""
_RESULTS = pytest.StashKey[dict[str, dict[str, str]]]()
_CHILD_SLACK_S = 300.0


def _marks(name: str) -> list[pytest.MarkDecorator]:
    if case(name).rdma:
        return [pytest.mark.rdma, requires_rdma_device]
    return []


@pytest.fixture(params=[pytest.param(name, id=name, marks=_marks(name)) for name in BACKEND_NAMES])
def backend(request: pytest.FixtureRequest) -> str:
    """A case id of `CASES` (a backend and its options); skipped, with the reason, where it
    cannot run on this host."""
    name: str = request.param
    c = case(name)
    reason = backend_unavailable_reason(c.backend)
    if reason is None and c.ucx_library not in (None, "auto", "wheel"):
        reason = _ucx_library_reason(c.ucx_library or "")
    if reason is not None:
        pytest.skip(reason)
    return name


_library_reasons: dict[str, str | None] = {}


def _ucx_library_reason(library: str) -> str | None:
    if library not in _library_reasons:
        _library_reasons[library] = availability.ucx_library_unavailable_reason(library)
    return _library_reasons[library]


@pytest.fixture
def transports(backend: str) -> Iterator[Callable[[], Transport]]:
    """A factory of transports of `backend`; every one is closed after the test."""
    made: list[Transport] = []

    def make() -> Transport:
        transport = make_transport(backend)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.close()


# -- one UCX build per process: other builds' items run in a child pytest ---------------------


def _build_of(library: str) -> str | None:
    """The libucp path that `library` resolves to here (None if it does not)."""
    from weight_transfer.backends.ucx_native import _builds

    try:
        return _builds.resolve(library, rdma=bool(availability.rdma_devices())).libucp
    except Exception:  # noqa: BLE001 - not installed: the `backend` fixture skips it
        return None


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(_CHILD_REPORT_ENV):
        return
    from weight_transfer.backends.ucx_native import loaded

    lib = loaded()
    home = lib.build.libucp if lib is not None else None
    builds: dict[str, str | None] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("backend") if callspec is not None else None
        library = case(name).ucx_library if isinstance(name, str) else None
        if library is None:
            continue
        if library not in builds:
            builds[library] = _build_of(library)
        build = builds[library]
        if build is None:
            continue
        home = home or build
        if build != home:
            item.stash[_DELEGATED] = build


def pytest_runtestloop(session: pytest.Session) -> None:
    """Run every other build's items in one child pytest per build, before the first test."""
    if session.config.option.collectonly or os.environ.get(_CHILD_REPORT_ENV):
        return
    groups: dict[str, list[pytest.Item]] = {}
    for item in session.items:
        if _DELEGATED in item.stash:
            groups.setdefault(item.stash[_DELEGATED], []).append(item)
    results: dict[str, dict[str, str]] = {}
    for build, items in groups.items():
        results.update(_run_child(session.config, build, items))
    session.config.stash[_RESULTS] = results


def _timeout_of(item: pytest.Item) -> float:
    mark = item.get_closest_marker("timeout")
    return float(mark.args[0]) if mark is not None and mark.args else 600.0


def _run_child(
    config: pytest.Config, build: str, items: list[pytest.Item]
) -> dict[str, dict[str, str]]:
    with tempfile.TemporaryDirectory(prefix="wt-conformance-") as tmp:
        report = os.path.join(tmp, "report.json")
        log = os.path.join(tmp, "output.txt")
        cmd = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            "-p", "tests.conformance._child_report", *[item.nodeid for item in items],
        ]  # fmt: skip
        env = {**os.environ, _CHILD_REPORT_ENV: report}
        limit = sum(_timeout_of(item) for item in items) + _CHILD_SLACK_S
        with open(log, "w") as out:
            try:
                subprocess.run(
                    cmd, cwd=config.rootpath, env=env, stdout=out, stderr=subprocess.STDOUT,
                    timeout=limit, check=False,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                pass
        try:
            with open(report) as fh:
                results: dict[str, dict[str, str]] = json.load(fh)
        except (OSError, ValueError):
            results = {}
        with open(log) as fh:
            tail = fh.read()[-4000:]
    for item in items:
        results.setdefault(
            item.nodeid,
            {"outcome": "failed", "text": f"the child pytest for {build} did not run it:\n{tail}"},
        )
    return results


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """An item another build's child ran: its outcome there, instead of running it here."""
    build = pyfuncitem.stash.get(_DELEGATED, None)
    if build is None:
        return None
    result = pyfuncitem.config.stash.get(_RESULTS, {}).get(pyfuncitem.nodeid)
    if result is None:
        pytest.fail(f"no child pytest ran this item (UCX build {build})", pytrace=False)
    if result["outcome"] == "skipped":
        pytest.skip(result["text"])
    if result["outcome"] != "passed":
        pytest.fail(f"in a child pytest for UCX build {build}:\n{result['text']}", pytrace=False)
    return True
