"""Reports from child processes to their parent: one pipe per child, msgpack, never pickle.

A `multiprocessing.Queue` shared by several children is the wrong tool where a child may die
(a fault test kills one on purpose; a crash kills one by accident): its writers share one lock,
and a child that dies while its feeder thread holds that lock blocks every other child's
reports forever. Here each child writes only to its own pipe, and a dead child's pipe reads EOF.
"""

from __future__ import annotations

import collections
import multiprocessing.connection as mp_connection
import time
from typing import Any

import msgpack


class Reporter:
    """A child's end of its own report pipe (pass it to the child as a `Process` argument).

    Messages are msgpack values (tuples arrive as lists; bytes, str, numbers, lists and dicts
    with str keys travel). Not thread-safe.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def put(self, msg: Any) -> None:
        """Send one message (blocks only while the pipe's buffer is full)."""
        self._conn.send_bytes(msgpack.packb(msg, use_bin_type=True))

    def close(self) -> None:
        """Close this end (the parent then reads EOF once it has read everything)."""
        self._conn.close()


class ReportInbox:
    """The parent's side: one pipe per child, read in arrival order."""

    def __init__(self, ctx: Any) -> None:
        """Args: ctx: the multiprocessing context the children are started with."""
        self._ctx = ctx
        self._readers: list[Any] = []
        self._writers: list[Any] = []
        self._pending: collections.deque[Any] = collections.deque()

    def reporter(self) -> Reporter:
        """A new pipe; hand the returned end to exactly one child."""
        reader, writer = self._ctx.Pipe(duplex=False)
        self._readers.append(reader)
        self._writers.append(writer)
        return Reporter(writer)

    def started(self) -> None:
        """Call once the children started: drops the parent's copies of the write ends, so a
        dead child's pipe reads EOF instead of staying open."""
        for w in self._writers:
            w.close()
        self._writers = []

    def get(self, timeout: float) -> Any | None:
        """The next message, or None if none arrived within `timeout` seconds."""
        if not self._pending and self._readers:
            for ready in mp_connection.wait(self._readers, timeout):
                conn: Any = ready  # one of our readers (wait's stubs return any waitable)
                try:
                    self._pending.append(
                        msgpack.unpackb(conn.recv_bytes(), raw=False, strict_map_key=False)
                    )
                except (EOFError, OSError):  # that child exited or was killed
                    self._readers.remove(conn)
        elif not self._pending:
            time.sleep(timeout)
        return self._pending.popleft() if self._pending else None

    def close(self) -> None:
        """Close the read ends."""
        for r in self._readers:
            r.close()
        self._readers = []
