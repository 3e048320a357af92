"""Spans of an update on the host's shared clock, written as one Perfetto trace."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from weight_transfer.spans import SpanLog, write_trace


def test_spans_of_two_processes_share_one_timeline(tmp_path: Path) -> None:
    trainer, worker = SpanLog("trainer rank 0"), SpanLog("vLLM worker rank 0")
    with trainer.span("update (whole)", 1):
        with trainer.span("sender.update", 1):
            time.sleep(0.002)
        th = threading.Thread(target=lambda: worker.add("refresh", 5, 9, 1), name="rpc")
        th.start()
        th.join()
    whole, inner = trainer.spans(1)[1], trainer.spans(1)[0]
    assert whole.name == "update (whole)" and inner.name == "sender.update"
    assert whole.start_ns <= inner.start_ns <= inner.end_ns <= whole.end_ns
    assert inner.seconds >= 0.002
    path = tmp_path / "t.json"
    write_trace(path, trainer.events(), worker.events())
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"trainer rank 0", "vLLM worker rank 0"}
    refresh = next(e for e in events if e["name"] == "refresh")
    assert (refresh["ts"], refresh["dur"], refresh["args"]) == (0.005, 0.004, {"step": 1})
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"rpc", threading.current_thread().name} <= threads


def test_a_span_log_keeps_the_newest_spans() -> None:
    log = SpanLog("p", max_spans=3)
    for i in range(5):
        log.add(f"s{i}", i, i + 1, step=i)
    assert [s.name for s in log.spans()] == ["s2", "s3", "s4"]
    assert [s.name for s in log.spans(step=3)] == ["s3"]
    with pytest.raises(ValueError, match="max_spans"):
        SpanLog("p", max_spans=0)
