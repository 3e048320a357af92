"""The process launcher: spawned children, one msgpack pipe each, failures named in one line."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from weight_transfer.cli.launch import (
    SLOW_HOST_ENV,
    Channel,
    Child,
    Launch,
    LaunchError,
    LaunchTimeoutError,
    describe_exit,
)

# -- children (module level: spawn imports them by name) ---------------------------------------


def reporter(index: int, count: int, out: Channel) -> None:
    for i in range(count):
        out.put(("report", index, i, b"\x00\x01" * (i + 1), {index: [1.5, "x"]}))


def big_report(nbytes: int, out: Channel) -> None:
    out.put(("big", os.urandom(nbytes)))


def raiser(out: Channel) -> None:
    out.put(("before",))
    raise ValueError("boom on purpose")


def waits_for_parent(out: Channel) -> None:
    out.put(("waiting",))
    out.get(timeout_s=300)  # nothing comes: the launcher must kill it


def dies(out: Channel) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def echo(out: Channel) -> None:
    while True:
        msg = out.get(timeout_s=60)
        if msg == "stop":
            return
        out.put(["echo", msg])


def env_reader(out: Channel) -> None:
    out.put(os.environ.get("WT_LAUNCH_TEST_VAR", "<unset>"))


def parent_and_env(out: Channel) -> None:
    out.put([os.getppid(), os.environ.get("WT_LAUNCH_TEST_VAR", "<unset>")])


def silent(out: Channel) -> None:
    time.sleep(300)


def bad_message(out: Channel) -> None:
    try:
        out.put(object())
    except TypeError as exc:  # msgpack refuses it: nothing falls back to pickle
        out.put(("refused", type(exc).__name__))


# -- tests -------------------------------------------------------------------------------------


def test_run_collects_every_report_with_per_child_args() -> None:
    got: list[tuple[str, Any]] = []
    launch = Launch([Child(f"c{i}", reporter, (i, 3)) for i in range(3)])
    outcome = launch.run(timeout_s=120, on_message=lambda name, msg: got.append((name, msg)))
    assert outcome.ok and outcome.errors == [] and outcome.killed == []
    assert outcome.exit_codes == {"c0": 0, "c1": 0, "c2": 0}
    for i in range(3):
        mine = [m for n, m in got if n == f"c{i}"]
        # In order per child; tuples arrive as lists, int map keys and bytes survive.
        assert mine == [["report", i, k, b"\x00\x01" * (k + 1), {i: [1.5, "x"]}] for k in range(3)]


def test_a_child_that_raises_is_named_first_and_the_rest_are_killed() -> None:
    launch = Launch(
        [
            Child("waiter", waits_for_parent),
            Child("bad", raiser),
            Child("big", big_report, (1 << 22,)),
        ]
    )
    got: list[tuple[str, Any]] = []
    t0 = time.monotonic()
    outcome = launch.run(timeout_s=120, grace_s=20.0, on_message=lambda n, m: got.append((n, m)))
    assert time.monotonic() - t0 < 60
    assert not outcome.ok
    assert outcome.failed[0] == "bad"
    assert outcome.errors[0] == "bad failed: ValueError: boom on purpose (exit code 1)"
    assert "ValueError: boom on purpose" in outcome.tracebacks["bad"]
    assert outcome.killed == ["waiter"]
    assert "waiter did not finish in time; killed" in outcome.errors
    assert outcome.exit_codes == {"waiter": -signal.SIGKILL, "bad": 1, "big": 0}
    assert ("bad", ["before"]) in got and ("waiter", ["waiting"]) in got
    (big,) = [m for n, m in got if n == "big"]
    assert big[0] == "big" and len(big[1]) == 1 << 22  # a large message is read whole
    with pytest.raises(LaunchError, match=r"^bad failed: ValueError") as info:
        outcome.check()
    assert info.value.child == "bad" and info.value.exit_code == 1


def test_a_killed_child_and_a_deadline() -> None:
    t0 = time.monotonic()
    outcome = Launch([Child("dead", dies), Child("slow", silent)]).run(timeout_s=240, grace_s=3)
    assert time.monotonic() - t0 < 120  # the grace after the failure, not the deadline
    assert outcome.errors[0] == "dead exited with code -9 (SIGKILL)"
    assert outcome.failed == ["dead", "slow"] and outcome.killed == ["slow"]
    outcome = Launch([Child("slow", silent)]).run(timeout_s=3)
    assert outcome.errors == ["slow did not finish in time; killed"]
    assert outcome.exit_codes == {"slow": -signal.SIGKILL}


def test_request_reply_and_the_errors_of_recv() -> None:
    with Launch([Child("echo", echo), Child("dead", dies), Child("silent", silent)]) as launch:
        for msg in (1, "two", [3, b"4"]):
            launch.send("echo", msg)
            assert launch.recv("echo", timeout_s=60) == ["echo", msg]
        with pytest.raises(LaunchError, match=r"^dead exited with code -9 \(SIGKILL\)$"):
            launch.recv("dead", timeout_s=60)
        with pytest.raises(LaunchTimeoutError, match=r"^silent sent nothing within 1 s"):
            launch.recv("silent", timeout_s=1)
        assert launch.failure() is not None and launch.failure().child == "dead"  # type: ignore[union-attr]
        launch.send("echo", "stop")
        codes = launch.join(timeout_s=60)
    assert codes == {"echo": 0, "dead": -signal.SIGKILL, "silent": -signal.SIGKILL}
    assert launch.killed == ["silent"]


def test_env_reaches_the_child_only_and_nothing_is_pickled() -> None:
    assert "WT_LAUNCH_TEST_VAR" not in os.environ
    with Launch(
        [Child("env", env_reader), Child("bad", bad_message)], env={"WT_LAUNCH_TEST_VAR": "set"}
    ) as launch:
        assert "WT_LAUNCH_TEST_VAR" not in os.environ
        assert launch.recv("env", timeout_s=60) == "set"
        assert launch.recv("bad", timeout_s=60) == ["refused", "TypeError"]
        assert launch.join(timeout_s=60) == {"env": 0, "bad": 0}


def test_bad_launches_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        Launch([Child("a", silent), Child("a", silent)])
    with pytest.raises(ValueError, match="at least one"):
        Launch([])
    assert describe_exit(None) == "still running"
    assert describe_exit(-15) == "exit code -15 (SIGTERM)"
    assert describe_exit(3) == "exit code 3"


def test_a_slow_host_scales_the_waits_and_starts_children_from_a_forkserver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WT_SLOW_HOST=N: every wait is N times the one given, children come from a forkserver
    (their parent is the server, not this process) and still get the launch's `env`."""
    monkeypatch.setenv(SLOW_HOST_ENV, "4")
    with Launch(
        [Child("probe", parent_and_env), Child("silent", silent)],
        env={"WT_LAUNCH_TEST_VAR": "set"},
    ) as launch:
        ppid, value = launch.recv("probe", timeout_s=60)
        assert ppid != os.getpid() and value == "set"
        t0 = time.monotonic()
        with pytest.raises(LaunchTimeoutError, match=r"^silent sent nothing within 2 s"):
            launch.recv("silent", timeout_s=0.5)
        assert time.monotonic() - t0 >= 2.0
    for bad in ("0.5", "fast"):
        monkeypatch.setenv(SLOW_HOST_ENV, bad)
        with pytest.raises(ValueError, match=f"WT_SLOW_HOST must be a number >= 1, got '{bad}'"):
            Launch([Child("probe", parent_and_env)])
