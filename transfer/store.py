"""The control plane's store, served from a process of its own with bounded memory and fds.

torch's `TCPStore` server keeps every value anyone on its port sends (up to 8 MiB each, any
number of them) and accepts any number of connections. Hosted inside trainer rank 0, that lets
a stranger on the port exhaust the training process's memory or file descriptors. So the
controller's store is served by a *store host*: one helper process per trainer process,
started on first use (`weight_transfer.store.main` in a new interpreter), which runs torch's
own `TCPStore` server for every store this process hosts. Its data segment (`RLIMIT_DATA`:
heap and private writable mappings) is capped at its footprint after start-up plus
`store_memory_bytes` (and a little per store for the server thread), its descriptors
(`RLIMIT_NOFILE`) at what it holds plus `store_max_connections` per store. Past the memory cap
the server refuses the request that would grow it (it closes that connection) or, where an
allocation fails outside a request, exits; past the descriptor cap new connections are closed
at once. Either way what a stranger can stop is the control plane (the members then fail,
naming the lost controller), not the training process.

The listening socket is created by the caller (bound to exactly the configured host) and handed
over with `SCM_RIGHTS`; requests and replies are single JSON datagrams over a Unix
`SOCK_SEQPACKET` pair (no pickle). The host exits when its parent does (the pair's end closes),
and every store it serves goes with it. Linux only.

The caps are the host's, the sum over the stores it serves: a process that hosts several
controllers at once (tests do; a trainer hosts one) lets a flood of one store use the others'
allowance. What is bounded is the host, never the training process.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 65536
_PER_STORE_DATA_BYTES = 64 << 20
"""Data-segment allowance of one store's server besides its values (thread stack, allocator)."""
_BASE_FDS = 16
"""Descriptors the host keeps free for itself besides the stores' connections."""
_HOST_MAIN = "import os, sys; from weight_transfer.store import main; os._exit(main(sys.argv[1:]))"
"""The store host's program (`-c`: `-m` would import this module twice, as the package's)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StoreLimits:
    """What one hosted store may use (from `ControlPlaneConfig`)."""

    memory_bytes: int
    """Bytes of values (and their bookkeeping) the store may hold."""
    max_connections: int
    """Connections it may hold open at once."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.max_connections <= 0:
            raise ValueError("store limits must be positive")


class HostedStore:
    """A store served by the store host. `stop` ends it (idempotent)."""

    def __init__(self, host: _Host, store_id: int) -> None:
        self._host = host
        self.store_id = store_id
        self._stopped = False

    @property
    def pid(self) -> int:
        """The store host's process id."""
        return self._host.pid

    def alive(self) -> bool:
        """True while the store host runs."""
        return self._host.alive()

    def stop(self) -> None:
        """Stop serving the store: its port closes and its values are dropped."""
        if self._stopped:
            return
        self._stopped = True
        if not self._host.alive():
            return
        try:
            self._host.request({"op": "stop", "id": self.store_id}, timeout_s=10.0)
        except (OSError, RuntimeError) as exc:
            log.warning("store %d: could not stop it: %s", self.store_id, exc)


class _Host:
    """The parent's handle on the store host process."""

    def __init__(self, timeout_s: float) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.creator = os.getpid()
        self._lock = threading.Lock()
        self._seq = 0
        """Number of the last request: replies carry it, so a late one is told apart."""
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _HOST_MAIN, str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            child.close()
        self._chan = parent
        try:
            hello = self._receive(timeout_s)
        except BaseException:
            self.kill()
            raise
        if not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"the store host did not start: {hello.get('error', hello)}")
        self.pid = int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        self._chan.settimeout(timeout_s)
        try:
            data = self._chan.recv(_MAX_MESSAGE_BYTES)
        except TimeoutError as exc:
            raise RuntimeError(f"the store host did not answer within {timeout_s:.0f} s") from exc
        if not data:
            raise RuntimeError(f"the store host exited (status {self.proc.poll()})")
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise RuntimeError(f"the store host sent {reply!r}")
        return reply

    def request(
        self, message: dict[str, Any], *, fds: tuple[int, ...] = (), timeout_s: float
    ) -> dict[str, Any]:
        """One request and its reply (one at a time).

        A request that timed out may still be answered later: its reply then waits in the
        channel, and is recognised by its number and dropped by the next request, never
        taken for that request's answer.
        """
        with self._lock:
            self._seq += 1
            seq = self._seq
            socket.send_fds(self._chan, [json.dumps({**message, "seq": seq}).encode()], list(fds))
            deadline = time.monotonic() + timeout_s
            while True:
                reply = self._receive(max(1e-3, deadline - time.monotonic()))
                if reply.get("seq") == seq:
                    break
                log.debug("store host: dropped the late reply %r", reply)
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error", reply)))
        return reply

    def kill(self) -> None:
        self._chan.close()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            log.warning("store host %d did not exit", self.proc.pid)


_host: _Host | None = None
_host_lock = threading.Lock()
_next_id = 0


def host_store(
    listener: socket.socket, host: str, limits: StoreLimits, timeout_s: float
) -> HostedStore:
    """Serve a store on `listener` (a bound, listening socket) from the store host.

    The socket is handed over and closed here. Starts the host first if this process has none
    (about as long as importing torch takes).

    Raises:
        RuntimeError: the host could not be started or refused the store (its reason).
    """
    global _host, _next_id
    try:
        with _host_lock:
            if _host is None or not _host.alive() or _host.creator != os.getpid():
                _host = _Host(max(timeout_s, 30.0))
            h = _host
            _next_id += 1
            store_id = _next_id
        port = int(listener.getsockname()[1])
        h.request(
            {
                "op": "host",
                "id": store_id,
                "host": host,
                "port": port,
                "timeout_s": timeout_s,
                "memory_bytes": limits.memory_bytes,
                "max_connections": limits.max_connections,
            },
            fds=(listener.fileno(),),
            timeout_s=max(timeout_s, 30.0),
        )
    finally:
        listener.close()
    return HostedStore(h, store_id)


def host_pid() -> int | None:
    """The store host's process id in this process, if one runs."""
    h = _host
    return h.pid if h is not None and h.alive() and h.creator == os.getpid() else None


# -- the store host process --------------------------------------------------------------------


def _data_bytes() -> int:
    """This process's data segment now (VmData), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _apply_limits(base_data: int, base_fds: int, live: list[StoreLimits]) -> None:
    """Cap the data segment and descriptors at the base plus every live store's share."""
    data = base_data + sum(s.memory_bytes + _PER_STORE_DATA_BYTES for s in live)
    fds = base_fds + _BASE_FDS + sum(s.max_connections + 2 for s in live)
    for which, soft in ((resource.RLIMIT_DATA, data), (resource.RLIMIT_NOFILE, fds)):
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))


def _serve(chan: socket.socket) -> None:
    import torch.distributed as dist

    base_data, base_fds = _data_bytes(), _open_fds()
    stores: dict[int, tuple[Any, StoreLimits]] = {}
    chan.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(chan, _MAX_MESSAGE_BYTES, 4)
        except OSError:
            return
        if not data:
            return  # the parent is gone
        seq = None
        try:
            req = json.loads(data)
            seq = req.get("seq")
            if req["op"] == "host":
                (listen_fd,) = fds
                limits = StoreLimits(
                    memory_bytes=int(req["memory_bytes"]),
                    max_connections=int(req["max_connections"]),
                )
                _apply_limits(base_data, base_fds, [s for _, s in stores.values()] + [limits])
                try:
                    store = dist.TCPStore(
                        str(req["host"]),
                        int(req["port"]),
                        is_master=True,
                        timeout=datetime.timedelta(seconds=float(req["timeout_s"])),
                        wait_for_workers=False,
                        use_libuv=True,
                        master_listen_fd=listen_fd,
                    )
                except BaseException:
                    try:
                        os.close(listen_fd)
                    except OSError:  # the failed server closed it already
                        pass
                    raise
                stores[int(req["id"])] = (store, limits)
                del store  # the dict holds the only reference: `stop` ends the server
            elif req["op"] == "stop":
                for fd in fds:
                    os.close(fd)
                stores.pop(int(req["id"]), None)
                _apply_limits(base_data, base_fds, [s for _, s in stores.values()])
            else:
                raise ValueError(f"unknown request {req.get('op')!r}")
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["seq"] = seq  # the parent matches replies to requests by it
        chan.send(json.dumps(reply).encode())


def main(argv: list[str]) -> int:
    """The store host's entry point (`_HOST_MAIN`): serves until the parent is gone."""
    chan = socket.socket(fileno=int(argv[0]))
    try:
        _serve(chan)
    except Exception as exc:  # noqa: BLE001 - reported to the parent if it still listens
        try:
            chan.send(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}).encode())
        except OSError:
            pass
        return 1
    return 0
