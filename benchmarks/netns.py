"""Hosts emulated on one machine: network namespaces on a bridge, each link shaped with `tc`.

`EmulatedCluster` makes one namespace per host and one "switch" namespace holding a Linux
bridge; every host has its own veth pair (``eth0`` inside the host, a bridge port inside the
switch). Both ends are shaped with a token bucket (`tc qdisc ... tbf`), so each host's link
carries at most the given rate each way, as a NIC would: the host end limits what the host
sends, the switch end what it receives. An optional `netem` delay sits in front of each
bucket. The switch namespace keeps the bridge away from the machine's own firewall and
interfaces. Needs root; `unavailable_reason` says why it cannot run here.

Processes enter a host with `enter_host` (called first thing in a spawned child, while it is
still single-threaded). Everything is removed on `close` (also on an exception inside the
``with`` block, and at interpreter exit if `close` was never reached).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence

log = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2
DEVICE = "eth0"
"""Name of every host's link inside its namespace."""
ADMIN_DIRS = "/usr/local/sbin:/usr/sbin:/sbin"
"""Where `ip` and `tc` live when PATH lacks them (a minimal PATH, as `env -i` gives, has no
sbin directory; Debian installs `tc` only there)."""


def tool_path(name: str) -> str | None:
    """The command `name` on PATH, else in `ADMIN_DIRS`; None when neither has it."""
    return shutil.which(name) or shutil.which(name, path=ADMIN_DIRS)


def _tool(name: str) -> str:
    path = tool_path(name)
    if path is None:
        raise RuntimeError(f"needs the {name!r} command (iproute2), on PATH or in {ADMIN_DIRS}")
    return path


def unavailable_reason() -> str | None:
    """Why namespaces with shaped links cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    for tool in ("ip", "tc"):
        if tool_path(tool) is None:
            return f"needs the {tool!r} command (iproute2), on PATH or in {ADMIN_DIRS}"
    probe = f"wtprobe{secrets.token_hex(3)}"
    r = subprocess.run([_tool("ip"), "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    try:
        r = subprocess.run(
            [
                _tool("tc"),
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "32kb",
                "latency",
                "50ms",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            return f"cannot shape a link with tc tbf here: {r.stderr.strip()}"
    finally:
        subprocess.run([_tool("ip"), "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    r = subprocess.run([_tool(cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkShape:
    """How every host link is shaped (each direction)."""

    rate_mbyte_per_s: float
    """Token-bucket rate in 10^6 bytes per second (of Ethernet frames, headers included)."""
    burst_bytes: int = 128 * 1024
    """Bucket size: at least one GSO segment (64 KiB) or the link stalls."""
    queue_latency_ms: float = 200.0
    """Longest a packet may wait in the bucket's queue before it is dropped."""
    delay_ms: float = 0.0
    """One-way delay added by netem in front of the bucket (0: none)."""

    def __post_init__(self) -> None:
        if not self.rate_mbyte_per_s > 0:
            raise ValueError(
                f"LinkShape.rate_mbyte_per_s must be positive, got {self.rate_mbyte_per_s}"
            )
        if self.burst_bytes < 65536 + 1514:
            raise ValueError("LinkShape.burst_bytes must hold one 64 KiB GSO segment")
        if self.delay_ms < 0 or self.queue_latency_ms <= 0:
            raise ValueError("LinkShape: delay_ms must be >= 0 and queue_latency_ms positive")

    def tc_args(self) -> list[str]:
        """The `tbf` arguments of this shape."""
        bits = int(self.rate_mbyte_per_s * 8e6)
        return [
            "tbf",
            "rate",
            f"{bits}bit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.queue_latency_ms:g}ms",
        ]


class EmulatedCluster:
    """`num_hosts` namespaces on one bridge, each link shaped (module docstring)."""

    def __init__(self, num_hosts: int, shape: LinkShape) -> None:
        if num_hosts < 2:
            raise ValueError("an emulated cluster needs at least 2 hosts")
        if num_hosts > 250:
            raise ValueError("at most 250 emulated hosts (one /24)")
        self.shape = shape
        tag = secrets.token_hex(3)
        self.tag = tag
        self.switch = f"wt{tag}sw"
        self.hosts = [f"wt{tag}h{i}" for i in range(num_hosts)]
        subnet = 1 + secrets.randbelow(250)
        self.ips = [f"10.215.{subnet}.{i + 1}" for i in range(num_hosts)]
        self._made: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _shape(self, ns: str, dev: str) -> None:
        s = self.shape
        if s.delay_ms > 0:
            try:
                _run(
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "handle",
                    "1:",
                    "netem",
                    "delay",
                    f"{s.delay_ms:g}ms",
                    "limit",
                    "100000",
                )
            except RuntimeError as exc:
                raise RuntimeError(
                    f"cannot add a {s.delay_ms:g} ms delay: tc netem failed ({exc}); this kernel "
                    "may lack sch_netem. Run without a delay."
                ) from exc
            _run(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "handle",
                "10:",
                *s.tc_args(),
            )
        else:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *s.tc_args())

    def _build(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        self._made.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        for i, (ns, ip) in enumerate(zip(self.hosts, self.ips, strict=True)):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            a, b = f"wt{self.tag}a{i}", f"wt{self.tag}b{i}"
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _run("ip", "link", "set", a, "netns", ns)
            _run("ip", "link", "set", b, "netns", sw)
            _run("ip", "-n", ns, "link", "set", a, "name", DEVICE)
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", DEVICE)
            _run("ip", "-n", ns, "link", "set", DEVICE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", sw, "link", "set", b, "master", "br0")
            _run("ip", "-n", sw, "link", "set", b, "up")
            self._shape(ns, DEVICE)  # what the host sends
            self._shape(sw, b)  # what the host receives
        log.info(
            "emulated cluster %s: %d hosts at %.1f MB/s per link",
            self.tag,
            len(self.hosts),
            self.shape.rate_mbyte_per_s,
        )

    def qdisc_stats(self) -> dict[str, str]:
        """`tc -s qdisc` of every host's link (sent bytes, drops, overlimits)."""
        out = {}
        for ns in self.hosts:
            r = subprocess.run(
                [_tool("tc"), "-n", ns, "-s", "qdisc", "show", "dev", DEVICE],
                capture_output=True,
                text=True,
                timeout=30,
            )
            out[ns] = r.stdout.strip()
        return out

    def close(self) -> None:
        """Delete every namespace made (their veths go with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._made):
            r = subprocess.run([_tool("ip"), "netns", "del", ns], capture_output=True, text=True)
            if r.returncode != 0:
                log.warning("could not delete namespace %s: %s", ns, r.stderr.strip())
        self._made.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftover_namespaces(names: Sequence[str] | None = None) -> list[str]:
    """Namespaces of emulated clusters that still exist (all ``wt*sw``/``wt*h*`` or `names`)."""
    r = subprocess.run([_tool("ip"), "netns", "list"], capture_output=True, text=True)
    have = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    if names is not None:
        return [n for n in have if n in set(names)]
    return [n for n in have if n.startswith("wt") and (n.endswith("sw") or "h" in n[8:])]


def enter_host(name: str) -> None:
    """Move this (still single-threaded) process into the namespace `name`.

    Like `ip netns exec`, it also remounts /sys in a private mount namespace: sysfs shows the
    network devices of the namespace that mounted it, and UCX lists devices there.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name}) failed")
    finally:
        os.close(fd)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
        raise OSError(ctypes.get_errno(), "making / a slave mount failed")
    libc.umount2(b"/sys", _MNT_DETACH)  # may not be mounted separately; the mount below decides
    if libc.mount(name.encode(), b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mounting sysfs failed")


__all__ = [
    "DEVICE",
    "EmulatedCluster",
    "LinkShape",
    "enter_host",
    "leftover_namespaces",
    "unavailable_reason",
]
