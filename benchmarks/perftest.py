"""The `ib_write_bw` baseline: perftest's RDMA WRITE bandwidth between two RDMA devices.

`ib_write_bw` (linux-rdma/perftest) is what RDMA users run to see what a pair of devices can
do: one RC queue pair, RDMA WRITEs of one size from a client into a server's registered
buffer, up to 128 outstanding. Beside the backends it is the ceiling: the same devices, the same
addresses, no library of ours in the way. Here the server runs on the receiver's device and
the client on the sender's, each with the GID of its own address (RoCE v2 over IPv4 where the
device has one, as the ibverbs backend chooses), and the connection is exchanged over TCP from
the sender's address to the receiver's.

perftest prints one average (and one peak) per run, measured by itself from the first post to
the last completion; so one run is one sample, and the harness runs it once per sample. It does
not check the data it writes, and its time covers the writes only (not the process start or
the queue-pair exchange, which `IbWriteBwRun.wall_s` includes).

Every wait has a timeout: the server's listening socket, the client's run, the server's exit.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from weight_transfer.backends._ibverbs_plan import (
    LINK_LAYER_INFINIBAND,
    GidType,
    gid_from_string,
    gid_ipv4,
    select_gid,
)

__all__ = [
    "MIN_ITERATIONS",
    "IbWriteBwReport",
    "IbWriteBwRun",
    "RdmaSide",
    "ib_write_bw_iterations",
    "parse_ib_write_bw",
    "roce_gid_index",
    "run_ib_write_bw",
    "unavailable_reason",
    "version",
]

EXECUTABLE = "ib_write_bw"
MIN_ITERATIONS = 5
"""perftest refuses fewer iterations ("Iteration num should be between 5 and 100000000")."""
RDMA_SYSFS = Path("/sys/class/infiniband")
_PROC_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_TCP_LISTEN = "0A"
_POLL_S = 0.05

# perftest's units: "MB/sec" are MiB (2**20 bytes) per second, "Gb/sec" 1e9 bits per second
# (its --help says so: "MiB=2^20 byte, while Gb=10^9 bits").
_BYTES_PER_S = {"MB/sec": float(1 << 20), "Gb/sec": 1e9 / 8}
_HEADER_RE = re.compile(
    r"#bytes\s+#iterations\s+BW peak\[(?P<peak>[^\]]+)\]\s+BW average\[(?P<avg>[^\]]+)\]"
)


@dataclasses.dataclass(frozen=True, slots=True)
class IbWriteBwReport:
    """The results row of one `ib_write_bw` run."""

    size_bytes: int
    """Bytes per write (`-s`)."""
    iterations: int
    """Writes in the run (`-n`)."""
    peak_bytes_per_s: float
    """perftest's peak bandwidth (its fastest stretch of iterations), bytes per second."""
    average_bytes_per_s: float
    """perftest's average bandwidth over the run, bytes per second."""


@dataclasses.dataclass(frozen=True, slots=True)
class IbWriteBwRun:
    """One client run: its report and how long the client process took from start to exit."""

    report: IbWriteBwReport
    wall_s: float
    """Seconds from starting the client to its exit: process start, QP exchange and writes."""


@dataclasses.dataclass(frozen=True, slots=True)
class RdmaSide:
    """One end of an `ib_write_bw` pair."""

    device: str
    """RDMA device name (`-d`), e.g. rxe0 or mlx5_0."""
    gid_index: int
    """GID index (`-x`)."""
    host: str
    """This side's address: the server's is the one the client connects to, the client's its
    source (`--source_ip`)."""
    port: int = 1
    """Port of the device (`-i`)."""


def parse_ib_write_bw(text: str) -> IbWriteBwReport:
    """Parse the results row of `ib_write_bw` output (client or server side).

    Raises:
        ValueError: no results row, a malformed one, or a unit other than MB/sec or Gb/sec.
    """
    lines = text.splitlines()
    for i, line in enumerate(lines):
        header = _HEADER_RE.search(line)
        if header is None:
            continue
        units = (header.group("peak"), header.group("avg"))
        for unit in units:
            if unit not in _BYTES_PER_S:
                raise ValueError(f"ib_write_bw output: unknown bandwidth unit {unit!r}")
        row = lines[i + 1].split() if i + 1 < len(lines) else []
        try:
            size, iterations = int(row[0]), int(row[1])
            peak, average = float(row[2]), float(row[3])
        except (IndexError, ValueError):
            raise ValueError(
                f"ib_write_bw output: the row under its header is not a result: "
                f"{lines[i + 1].strip() if i + 1 < len(lines) else '(end of output)'!r}"
            ) from None
        return IbWriteBwReport(
            size_bytes=size,
            iterations=iterations,
            peak_bytes_per_s=peak * _BYTES_PER_S[units[0]],
            average_bytes_per_s=average * _BYTES_PER_S[units[1]],
        )
    last = next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")
    raise ValueError(f"ib_write_bw output has no results row; its last line: {last!r}")


def ib_write_bw_iterations(size_bytes: int, min_sample_bytes: int) -> int:
    """Writes per run: enough to cover `min_sample_bytes`, and at least perftest's minimum."""
    return max(MIN_ITERATIONS, -(-min_sample_bytes // size_bytes))


def unavailable_reason(devices: Sequence[str], sysfs: Path = RDMA_SYSFS) -> str | None:
    """Why `ib_write_bw` cannot run between `devices` here, or None."""
    if shutil.which(EXECUTABLE) is None:
        return f"{EXECUTABLE} is not on PATH (perftest: apt-get install perftest)"
    try:
        present = sorted(p.name for p in sysfs.iterdir())
    except OSError:
        present = []
    missing = [d for d in devices if d not in present]
    if missing:
        return (
            f"RDMA device {', '.join(missing)} absent ({sysfs} lists "
            f"{', '.join(present) if present else 'none'})"
        )
    return None


def version(timeout_s: float = 30.0) -> str | None:
    """What `ib_write_bw --version` prints (perftest's version), or None where it cannot run."""
    try:
        done = subprocess.run(
            [EXECUTABLE, "--version"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # unpopulated GID entries answer EINVAL to a read of their type
        return None


def roce_gid_index(
    device: str, *, port: int = 1, address: str | None = None, sysfs: Path = RDMA_SYSFS
) -> int:
    """The GID index `ib_write_bw -x` should use on `device`'s `port`.

    On RoCE the entry of type RoCE v2 whose IPv4-mapped address is `address`, where the device
    has one; otherwise the ibverbs backend's own choice (`select_gid`: RoCE v2 with an IPv4
    address first). On InfiniBand the port GID.

    Raises:
        ValueError: the port has no GID table or no usable entry.
    """
    root = sysfs / device / "ports" / str(port)
    link_layer = _read(root / "link_layer") or ""
    try:
        names = sorted((p.name for p in (root / "gids").iterdir()), key=int)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{device} port {port}: cannot read its GID table under {root}") from exc
    entries: list[tuple[int, GidType, bytes]] = []
    for name in names:
        text = _read(root / "gids" / name)
        if text is None:
            continue
        gid = gid_from_string(text)
        if gid == bytes(16):
            continue
        kind = _read(root / "gid_attrs" / "types" / name)
        gtype = GidType.ROCE_V2 if kind == GidType.ROCE_V2.value else GidType.IB_ROCE_V1
        entries.append((int(name), gtype, gid))
    if address is not None and link_layer != LINK_LAYER_INFINIBAND:
        for index, gtype, gid in entries:
            if gtype is GidType.ROCE_V2 and gid_ipv4(gid) == address:
                return index
    return select_gid(entries, link_layer=link_layer)


def _listening(port: int) -> bool:
    """Whether any socket of this network namespace listens on TCP `port` (/proc/net/tcp*).

    Looking is all: a connection to perftest's server would be taken for its client.
    """
    for path in _PROC_TCP:
        try:
            lines = path.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _TCP_LISTEN:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _common_args(side: RdmaSide, size_bytes: int, iterations: int, tcp_port: int) -> list[str]:
    # -F: run even where the CPU frequency governor is not at its maximum (it would only warn).
    return [
        EXECUTABLE, "-d", side.device, "-i", str(side.port), "-x", str(side.gid_index),
        "-s", str(size_bytes), "-n", str(iterations), "-p", str(tcp_port), "-F",
    ]  # fmt: skip


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-2:]) if lines else "(no output)"


def run_ib_write_bw(
    *,
    server: RdmaSide,
    client: RdmaSide,
    size_bytes: int,
    iterations: int,
    timeout_s: float,
) -> IbWriteBwRun:
    """One `ib_write_bw` run: a server on `server`'s device, a client on `client`'s.

    Blocks until both exited (each wait at most `timeout_s`); kills what is still running on
    the way out.

    Raises:
        TimeoutError: the server did not listen, or a side did not finish, in time.
        RuntimeError: a side exited with an error, or its report is not of this run.
    """
    tcp_port = _free_port(server.host)
    what = f"{EXECUTABLE} {server.device} <- {client.device}, {size_bytes} B x {iterations}"
    srv = subprocess.Popen(
        _common_args(server, size_bytes, iterations, tcp_port),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not _listening(tcp_port):
            if srv.poll() is not None:
                out = srv.communicate()[0]
                raise RuntimeError(
                    f"{what}: the server exited with {srv.returncode} before listening: "
                    f"{_tail(out)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what}: the server did not listen on port {tcp_port} within {timeout_s} s"
                )
            time.sleep(_POLL_S)
        args = _common_args(client, size_bytes, iterations, tcp_port)
        args += ["--source_ip", client.host, server.host]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{what}: the client did not finish within {timeout_s} s") from None
        wall_s = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(
                f"{what}: the client exited with {done.returncode}: {_tail(done.stdout)}"
            )
        try:
            srv_out = srv.communicate(timeout=timeout_s)[0]
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{what}: the server did not exit within {timeout_s} s") from None
        if srv.returncode != 0:
            raise RuntimeError(f"{what}: the server exited with {srv.returncode}: {_tail(srv_out)}")
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(timeout=timeout_s)
    try:
        report = parse_ib_write_bw(done.stdout)
    except ValueError as exc:
        raise RuntimeError(f"{what}: {exc}") from None
    if (report.size_bytes, report.iterations) != (size_bytes, iterations):
        raise RuntimeError(
            f"{what}: the client reported {report.size_bytes} B x {report.iterations}, "
            "not what it was asked for"
        )
    return IbWriteBwRun(report=report, wall_s=wall_s)
