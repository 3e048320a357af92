"""pytest plugin of a conformance child run (tests/conformance/conftest.py): writes each item's
outcome and text to the JSON file named by `WT_CONFORMANCE_CHILD_REPORT`."""

from __future__ import annotations

import json
import os

import pytest

_results: dict[str, dict[str, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _results.get(report.nodeid)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        text = report.longreprtext
        if report.skipped and isinstance(report.longrepr, tuple):
            text = str(report.longrepr[2]).removeprefix("Skipped: ")
        _results[report.nodeid] = {"outcome": report.outcome, "text": text}
    elif (
        report.when == "teardown"
        and report.failed
        and (entry is None or entry["outcome"] == "passed")
    ):
        _results[report.nodeid] = {"outcome": "failed", "text": report.longreprtext}


def pytest_sessionfinish(session: pytest.Session) -> None:
    with open(os.environ["WT_CONFORMANCE_CHILD_REPORT"], "w") as fh:
        json.dump(_results, fh)
