"""One process launcher for the demos, the benchmarks and the tests: spawn, one pipe per child.

A `Launch` starts a few named children (`Child`: a module-level function and its plain
arguments), each a `spawn`ed process with its own duplex pipe to the parent, and hands the child
its end of that pipe, a `Channel`, as the function's last argument. Messages on the pipes are
msgpack values (tuples arrive as lists; bytes, str, numbers, lists and dicts travel), never
pickle: spawn pickles only the target function (by name) and its arguments, once, at start.

Every wait takes a timeout and every exit code is read. A child that exits non-zero, raises,
or outlives its deadline is named in one line with its exit code (`LaunchError`), and the
others get a short grace to exit on their own before they are killed. `Launch.run` does all of
that for the common case (collect reports until every child exited); `get`, `recv`, `send`,
`kill` and `join` serve callers with a protocol of their own (the transport harness's
request/reply, the fault tests' kills).

Slow hosts (`SLOW_HOST_ENV`, the launcher's one setting, read from the environment since the
launcher belongs to the CLI, tests and benchmarks, not the library): `WT_SLOW_HOST=N` (a number,
at least 1) says that this host runs everything about N times slower than a normal one, as a VM
without hardware virtualization does (the Soft-RoCE VM of tests/softroce runs under TCG, about
15x slower: `import torch` alone takes 22 s there). Then every wait a caller gives the launcher
(`get`, `recv`, `run`, `join`, `close`) is multiplied by N, and children are started by a
`forkserver` that has imported torch and this package once, instead of by `spawn`, so a child
does not pay that import again. A forkserver child is, like a spawned one, a fresh interpreter
state forked from a single-threaded server: it inherits nothing of the parent but its
arguments and its environment (`env` is applied in the child as well, since the server's own
environment is the one it was started with). Unset or 1: spawn, and waits as given.

Why one pipe per child and not one `multiprocessing.Queue` shared by all: a shared queue's
writers share one lock, and a child that dies while its feeder thread holds that lock blocks
every other child's reports forever (the fault tests kill children on purpose). Here each child
writes only to its own pipe, and a dead child's pipe reads EOF.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import msgpack

__all__ = [
    "SLOW_HOST_ENV",
    "Channel",
    "Child",
    "Launch",
    "LaunchError",
    "LaunchTimeoutError",
    "Outcome",
    "describe_exit",
    "slow_host_factor",
]

SLOW_HOST_ENV = "WT_SLOW_HOST"
"""Environment variable: how many times slower than a normal host this one runs (see above)."""

_PRELOAD = ["torch", "weight_transfer", "transformers"]
"""What a slow host's forkserver imports once for all its children (a module that is not
installed is skipped): torch and this package, which every child imports, and transformers,
which the demo's and the tests' trainers import (23 s of each child's start in the VM)."""


def slow_host_factor() -> float:
    """`WT_SLOW_HOST` as a number (1.0 when unset).

    Raises:
        ValueError: the variable is set to something other than a number >= 1.
    """
    raw = os.environ.get(SLOW_HOST_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        factor = float(raw)
    except ValueError:
        factor = 0.0
    if not factor >= 1.0:
        raise ValueError(f"{SLOW_HOST_ENV} must be a number >= 1, got {raw!r}")
    return factor


_ERROR_EXT = 17
"""msgpack extension code of the launcher's own "this child raised" report (its traceback);
no user message can take that form."""


def _pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def describe_exit(code: int | None) -> str:
    """`exit code 1`, `exit code -9 (SIGKILL)`, or `still running` for None."""
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


class LaunchError(RuntimeError):
    """A child failed: it exited non-zero, raised, or did not finish in time.

    `str()` is one line naming the child and its exit code. Attributes: `child` (its name),
    `exit_code` (None if it was still running), `child_traceback` (what it raised, "" if it
    died without saying).
    """

    def __init__(
        self, message: str, *, child: str, exit_code: int | None, child_traceback: str = ""
    ) -> None:
        super().__init__(message)
        self.child = child
        self.exit_code = exit_code
        self.child_traceback = child_traceback


class LaunchTimeoutError(LaunchError, TimeoutError):
    """A child sent nothing within the time it was given (it may still be running)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Child:
    """One process to start."""

    name: str
    """Names the child in every message about it (`trainer0`, `engine1`, ...)."""
    target: Callable[..., object]
    """A module-level function (spawn imports it by name); called as `target(*args, channel)`."""
    args: tuple[Any, ...] = ()
    """Plain arguments (numbers, strings, frozen config dataclasses, multiprocessing events)."""


class Channel:
    """One end of a child's pipe: the child's (its last argument) or the parent's.

    Not thread-safe; one reader and one writer per end.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def put(self, msg: Any) -> None:
        """Send one msgpack value (blocks only while the pipe's buffer is full)."""
        self._conn.send_bytes(_pack(msg))

    def get(self, timeout_s: float) -> Any:
        """The next message from the other end.

        Raises:
            TimeoutError: nothing arrived within `timeout_s` seconds.
            EOFError: the other end closed its pipe (or its process died).
        """
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"no message from the parent within {timeout_s:.0f} s")
        return _unpack(self._conn.recv_bytes())

    def close(self) -> None:
        """Close this end (the other end reads EOF once it has read everything)."""
        self._conn.close()


def _child_main(
    target: Callable[..., object], args: tuple[Any, ...], conn: Any, env: Mapping[str, str]
) -> None:
    """What each spawned process runs: the target, and a traceback report if it raises."""
    os.environ.update(env)  # a forkserver child has the server's environment, not the parent's
    channel = Channel(conn)
    try:
        target(*args, channel)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(
                    _pack(msgpack.ExtType(_ERROR_EXT, f"SystemExit: {exc.code}".encode()))
                )
        raise
    except BaseException:
        with contextlib.suppress(OSError, ValueError):  # the parent may be gone, or the pipe
            conn.send_bytes(_pack(msgpack.ExtType(_ERROR_EXT, traceback.format_exc().encode())))
        raise
    finally:
        with contextlib.suppress(OSError):
            channel.close()


@dataclasses.dataclass(slots=True)
class Outcome:
    """How a `Launch.run` ended."""

    exit_codes: dict[str, int | None]
    """Child name -> exit code (None: could not be reaped even after a kill)."""
    errors: list[str]
    """One line per child that failed, the first failure first; empty when all exited 0."""
    failed: list[str]
    """The names of those children, in the same order."""
    tracebacks: dict[str, str]
    """Child name -> what it raised (children that raised only)."""
    killed: list[str]
    """Children the launcher killed (they outlived the deadline or the grace after a failure)."""

    @property
    def ok(self) -> bool:
        """Every child exited 0 in time."""
        return not self.errors

    def check(self) -> None:
        """Raise `LaunchError` with the first failure's line unless `ok`."""
        if self.errors:
            name = self.failed[0]
            raise LaunchError(
                self.errors[0],
                child=name,
                exit_code=self.exit_codes.get(name),
                child_traceback=self.tracebacks.get(name, ""),
            )


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


class Launch:
    """Named spawned children, one duplex msgpack pipe each; a context manager.

    `start()` (or `with Launch(...) as launch:`) starts the children in the given order (a
    child that hosts something the others connect to goes first). Leaving the `with` block, or
    `close()`, kills whatever still runs and closes the pipes; every exit code is then read.
    Not thread-safe.
    """

    def __init__(
        self,
        children: Sequence[Child],
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        children: what to start, in start order; names must be unique.
        env: variables set in the children's environment only (spawn copies the parent's
            environment at start; the parent's own is restored right after).
        """
        names = [c.name for c in children]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique, got {names}")
        if not children:
            raise ValueError("a launch needs at least one child")
        self._children = list(children)
        self._env = dict(env or {})
        self._slow = slow_host_factor()
        self._ctx: Any
        if self._slow > 1.0:
            self._ctx = mp.get_context("forkserver")
            self._ctx.set_forkserver_preload(
                [m for m in _PRELOAD if importlib.util.find_spec(m) is not None]
            )
        else:
            self._ctx = mp.get_context("spawn")
        self._procs: dict[str, Any] = {}
        self._conns: dict[str, Any] = {}
        self._open: dict[Any, str] = {}  # parent ends not yet at EOF -> child name
        self._pending: collections.deque[tuple[str, Any]] = collections.deque()
        self.tracebacks: dict[str, str] = {}
        """Child name -> what it raised, as reported before it exited."""
        self.killed: list[str] = []
        """Children this launch killed."""

    # -- starting and stopping ------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The children's names, in start order."""
        return [c.name for c in self._children]

    def start(self) -> Launch:
        """Start every child, in order. On a failure to start, stops the ones started."""
        if self._procs:
            raise RuntimeError("this launch was already started")
        child_ends = []
        try:
            with _environment(self._env):
                for child in self._children:
                    parent_end, child_end = self._ctx.Pipe(duplex=True)
                    child_ends.append(child_end)
                    proc = self._ctx.Process(
                        target=_child_main,
                        args=(child.target, child.args, child_end, self._env),
                        name=f"wt-{child.name}",
                    )
                    self._conns[child.name] = parent_end
                    proc.start()
                    self._open[parent_end] = child.name
                    self._procs[child.name] = proc
        except BaseException:
            self.close()
            raise
        finally:
            # The parent's copies of the child ends: closed, so a dead child's pipe reads EOF.
            for end in child_ends:
                end.close()
        return self

    def __enter__(self) -> Launch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, grace_s: float = 0.0) -> dict[str, int | None]:
        """Give running children `grace_s` seconds, kill the rest, close the pipes.

        Returns every child's exit code.
        """
        codes = self.join(grace_s) if self._procs else {}  # join scales the grace
        for conn in self._conns.values():
            conn.close()
        self._open.clear()
        return codes

    def kill(self, name: str) -> None:
        """SIGKILL child `name` (by its process handle) and reap it."""
        proc = self._procs[name]
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=10)

    def pid(self, name: str) -> int:
        """Child `name`'s process id."""
        pid: int | None = self._procs[name].pid
        assert pid is not None, "not started"
        return pid

    def exit_code(self, name: str) -> int | None:
        """Child `name`'s exit code, None while it runs (never blocks)."""
        code: int | None = self._procs[name].exitcode
        return code

    def exit_codes(self) -> dict[str, int | None]:
        """Every child's exit code so far (None: running)."""
        return {n: self.exit_code(n) for n in self._procs}

    def join(self, timeout_s: float) -> dict[str, int | None]:
        """Wait up to `timeout_s` seconds in all for every child to exit, reading (and keeping)
        their messages meanwhile so none blocks on a full pipe; kill the ones still running.

        Returns every child's exit code; the killed ones are added to `killed`.
        """
        deadline = time.monotonic() + timeout_s * self._slow
        while any(p.exitcode is None for p in self._procs.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._read(min(left, 0.1))
        for name, proc in self._procs.items():
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=10)
                self.killed.append(name)
        self._drain()
        return self.exit_codes()

    # -- messages -------------------------------------------------------------------------

    def send(self, name: str, msg: Any) -> None:
        """Send one msgpack value to child `name`."""
        self._conns[name].send_bytes(_pack(msg))

    def get(self, timeout_s: float) -> tuple[str, Any] | None:
        """The next message from any child, in arrival order, as (child name, message), or
        None if none arrived within `timeout_s` seconds."""
        return self._get(timeout_s * self._slow)

    def _get(self, timeout_s: float) -> tuple[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                break
        return self._pending.popleft() if self._pending else None

    def recv(self, name: str, timeout_s: float) -> Any:
        """The next message from child `name` (others' messages stay queued for `get`).

        Raises:
            LaunchError: the child raised, or exited before sending one.
            LaunchTimeoutError: nothing from it within `timeout_s` seconds.
        """
        timeout_s *= self._slow
        deadline = time.monotonic() + timeout_s
        conn = self._conns[name]
        while True:
            for i, (who, msg) in enumerate(self._pending):
                if who == name:
                    del self._pending[i]
                    return msg
            if name in self.tracebacks:
                raise self._error(name)
            if conn not in self._open:
                # EOF: the child is gone (or going); its exit code says how.
                self._procs[name].join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
                raise self._error(name)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchTimeoutError(
                    f"{name} sent nothing within {timeout_s:.0f} s "
                    f"({describe_exit(self.exit_code(name))})",
                    child=name,
                    exit_code=self.exit_code(name),
                )
            self._read(left, only=conn)

    def failure(self) -> LaunchError | None:
        """The first child that raised or exited non-zero so far, as an error; else None."""
        for name in self._procs:
            code = self.exit_code(name)
            if name in self.tracebacks or code not in (None, 0):
                return self._error(name)
        return None

    def run(
        self,
        *,
        timeout_s: float,
        on_message: Callable[[str, Any], None] | None = None,
        grace_s: float = 15.0,
    ) -> Outcome:
        """Start (unless started), hand every message to `on_message(child, message)` until
        every child exited, then return how each ended. Never raises for a child's failure.

        When a child fails (exits non-zero or raises) the others get `grace_s` seconds to exit
        on their own (they usually raise on their own timeouts, naming the lost peer); any
        child still running at the deadline (`timeout_s` from now) or after the grace is
        killed. `Outcome.errors` lists the first failure first.
        """
        if not self._procs:
            self.start()
        deadline = time.monotonic() + timeout_s * self._slow
        grace_s *= self._slow
        first: str | None = None
        try:
            while any(p.exitcode is None for p in self._procs.values()):
                if first is None and (err := self.failure()) is not None:
                    first = err.child
                    deadline = min(deadline, time.monotonic() + grace_s)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if (got := self._get(min(left, 0.2))) is not None and on_message is not None:
                    on_message(*got)
            self.join(0.0)
            while (got := self._get(0.0)) is not None:
                if on_message is not None:
                    on_message(*got)
        finally:
            codes = self.close()
        if first is None and (err := self.failure()) is not None:
            first = err.child
        order = ([first] if first is not None else []) + [n for n in self._procs if n != first]
        errors: list[str] = []
        failed: list[str] = []
        for name in order:
            if name in self.tracebacks or name in self.killed or codes[name] != 0:
                line = str(self._error(name))
                if name in self.killed and name in self.tracebacks:
                    line = f"{name} failed: {_last_line(self.tracebacks[name])} (then hung; killed)"
                elif name in self.killed:
                    line = f"{name} did not finish in time; killed"
                errors.append(line)
                failed.append(name)
        return Outcome(
            exit_codes=codes,
            errors=errors,
            failed=failed,
            tracebacks=dict(self.tracebacks),
            killed=list(self.killed),
        )

    # -- internals ------------------------------------------------------------------------

    def _error(self, name: str) -> LaunchError:
        code = self.exit_code(name)
        tb = self.tracebacks.get(name, "")
        if tb:
            message = f"{name} failed: {_last_line(tb)} ({describe_exit(code)})"
        elif code is None:
            message = f"{name} closed its pipe and is still running"
        else:
            message = f"{name} exited with {describe_exit(code).removeprefix('exit ')}"
        return LaunchError(message, child=name, exit_code=code, child_traceback=tb)

    def _read(self, timeout_s: float, only: Any = None) -> bool:
        """Wait up to `timeout_s` for messages (from one pipe, or any); queue what arrives.

        Returns False when there was nothing left to wait on.
        """
        conns = [only] if only is not None else list(self._open)
        conns = [c for c in conns if c in self._open]
        if not conns:
            if only is None:
                time.sleep(max(0.0, min(timeout_s, 0.05)))
            return False
        for ready in mp_connection.wait(conns, timeout_s):
            self._read_one(ready)
        return True

    def _read_one(self, conn: Any) -> None:
        name = self._open[conn]
        try:
            msg = _unpack(conn.recv_bytes())
        except (EOFError, OSError):  # that child exited or was killed
            del self._open[conn]
            return
        if isinstance(msg, msgpack.ExtType) and msg.code == _ERROR_EXT:
            self.tracebacks[name] = msg.data.decode(errors="replace")
        else:
            self._pending.append((name, msg))

    def _drain(self) -> None:
        """Read what exited children left in their pipes, up to EOF. A pipe that stays open and
        quiet (a grandchild holding it) ends the drain; one that keeps talking, after 10 s."""
        deadline = time.monotonic() + 10.0
        while self._open and time.monotonic() < deadline:
            if not mp_connection.wait(list(self._open), 0.05):
                if all(p.exitcode is not None for p in self._procs.values()):
                    break
                continue
            for ready in mp_connection.wait(list(self._open), 0):
                self._read_one(ready)


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set `env` in this process while children are spawned, then restore it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
