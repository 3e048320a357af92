"""`weight-transfer bench control-plane`: the control plane's load at 8, 64 and 384 members.

Every member is the real thing, as a thread of this process: the `Controller`, one
`WeightSender` per trainer rank and one `WeightReceiver` per engine, over the loopback backend,
with a data plane reduced to nothing (each engine holds one 1 KiB tensor that one trainer rank
writes), so what an update costs here is its control plane. The engines' threads sit in
`wait_for_version(k)` as an engine that waits for update k does; the trainer ranks' threads call
`update(k)` together.

Counted, for every member, are the store requests it sends: `torch.distributed.TCPStore` is
replaced (in this process only) by a wrapper that counts each call and forwards it. A call is
the number of requests the store's server handles for it (`get` and `multi_get` wait for their
keys first: two; everything else one); a blocking `wait` is one request however long it blocks.

Reported per cluster: store requests per update (all members, and per member kind), requests
per second while idle (engines waiting for an update that does not come yet), the update's
latency (first rank's `update` call to the last member's return: trainer ranks from `update`,
engines from `wait_for_version`), its commit latency (the last rank's executor finished ->
the last member returned) and the "go" fan-out (rank 0's go -> the last rank's executor start),
medians and p10-p90 over the timed updates, and the CPU seconds of this process (and of the
store's process, where it has one) per update.

Threads share one interpreter: on a 2-core machine the latencies include the members' own
Python work queueing for the cores, which on a real cluster runs on 384 hosts in parallel. The
request counts do not depend on that.

    python -m weight_transfer.benchmarks.bench_control_plane --members 8,64,384 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import secrets
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

REQUESTS_PER_CALL = {"get": 2, "multi_get": 2}
"""Server requests per client call where it is not one (the client waits for the keys first)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchControlPlaneConfig:
    """What `bench control-plane` runs."""

    members: tuple[int, ...] = (8, 64, 384)
    """Cluster sizes (trainer ranks + engines); two thirds are trainer ranks (256 + 128 at 384)."""
    updates: int = 10
    """Timed updates per cluster (after the warm-ups)."""
    warmups: int = 2
    """Untimed updates first."""
    idle_s: float = 2.0
    """Seconds to count requests while the engines wait and no update runs."""
    data_plane_s: float = 1.0
    """How long every rank's writes take (each batch reads as unfinished this long), so the
    control plane's work during the data plane is counted as in a real update."""
    timeout_s: float = 300.0
    """Control-plane and update timeouts of every member."""
    json_path: str | None = None
    """Where to write the results."""

    def __post_init__(self) -> None:
        if not self.members or min(self.members) < 2:
            raise ValueError("every cluster needs at least 2 members (a trainer and an engine)")
        if self.updates < 1 or self.warmups < 0:
            raise ValueError("updates must be >= 1 and warmups >= 0")
        if self.idle_s < 0 or self.timeout_s <= 0 or self.data_plane_s < 0:
            raise ValueError("idle_s and data_plane_s must be >= 0 and timeout_s positive")


def split(members: int) -> tuple[int, int]:
    """(trainer ranks, engines): two thirds trainer ranks, rounded, at least one of each."""
    trainers = min(members - 1, max(1, round(members * 2 / 3)))
    return trainers, members - trainers


# -- counting store requests ------------------------------------------------------------------


class _Counts:
    """Requests per (member kind, op), summed over every store connection of this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by: collections.Counter[tuple[str, str]] = collections.Counter()
        self.by_member: collections.Counter[str] = collections.Counter()

    def add(self, kind: str, member: str, op: str) -> None:
        n = REQUESTS_PER_CALL.get(op, 1)
        with self.lock:
            self.by[(kind, op)] += n
            self.by_member[member] += n

    def snapshot(self) -> tuple[collections.Counter[tuple[str, str]], collections.Counter[str]]:
        with self.lock:
            return collections.Counter(self.by), collections.Counter(self.by_member)

    def reset(self) -> None:
        with self.lock:
            self.by.clear()
            self.by_member.clear()


COUNTS = _Counts()
_who = threading.local()
"""The member kind and name a thread's store connections are counted for."""

_STORE_OPS = frozenset(
    "set get check wait add compare_set delete_key multi_get multi_set num_keys append "
    "queue_push queue_pop queue_len list_keys".split()
)


class _CountingStore:
    """Forwards every call to a real store, counting the requests (see the module doc)."""

    def __init__(self, store: Any, kind: str, member: str) -> None:
        self._store = store
        self._kind = kind
        self._member = member

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in _STORE_OPS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            COUNTS.add(self._kind, self._member, name)
            return attr(*args, **kwargs)

        return call


def _install_counting() -> Callable[[], None]:
    """Replace torch.distributed.TCPStore by a counting factory; returns the undo.

    A thread started by a member counts for that member (a connection may be opened, or a wait
    run, on a helper thread).
    """
    import torch.distributed as dist

    real = dist.TCPStore
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        kind, member = getattr(_who, "kind", None), getattr(_who, "member", "")
        if kind is not None:
            body = self.run

            def run_as() -> None:
                _as(kind, member)
                body()

            self.run = run_as  # type: ignore[method-assign]
        real_start(self)

    threading.Thread.start = start  # type: ignore[method-assign]

    def factory(*args: Any, **kwargs: Any) -> Any:
        kind = getattr(_who, "kind", "other")
        member = getattr(_who, "member", "other")
        return _CountingStore(real(*args, **kwargs), kind, member)

    dist.TCPStore = factory  # type: ignore[misc,assignment]

    def undo() -> None:
        dist.TCPStore = real  # type: ignore[misc]
        threading.Thread.start = real_start  # type: ignore[method-assign]

    return undo


def _as(kind: str, member: str) -> None:
    _who.kind, _who.member = kind, member


# -- one cluster ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spread(values: Sequence[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {"median": 0.0, "p10": 0.0, "p90": 0.0, "min": 0.0, "max": 0.0}

    def q(p: float) -> float:
        return v[min(len(v) - 1, max(0, round(p * (len(v) - 1))))]

    return {
        "median": statistics.median(v),
        "p10": q(0.1),
        "p90": q(0.9),
        "min": v[0],
        "max": v[-1],
    }


def _store_process_cpu_s() -> float | None:
    """CPU seconds of the store's own process, where the runtime has one (else None)."""
    try:
        from weight_transfer import store as store_module
    except ImportError:
        return None
    pid = store_module.host_pid()
    if pid is None:
        return None
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_cluster(
    members: int, cfg: BenchControlPlaneConfig, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Build one cluster, run its updates, return the measured numbers."""
    import torch

    import weight_transfer.pipeline as pipeline
    from weight_transfer.backends.base import Transport
    from weight_transfer.config import ControlPlaneConfig, SenderConfig, TransferConfig
    from weight_transfer.controller import Controller
    from weight_transfer.planner.plan import PlannerConfig
    from weight_transfer.planner.recipes import identity
    from weight_transfer.receiver import WeightReceiver
    from weight_transfer.sender import WeightSender

    n, m = split(members)
    shape = (16, 16)
    control = ControlPlaneConfig(
        port=_free_port(), token=secrets.token_hex(16), timeout_s=cfg.timeout_s
    )
    config = TransferConfig(
        transport="loopback",
        num_engines=m,
        control=control,
        sender=SenderConfig(update_timeout_s=cfg.timeout_s),
        planner=PlannerConfig(memory_budget_bytes=1 << 16),
    )
    g = torch.Generator().manual_seed(members)
    per_engine = -(-n // m) + 1  # enough writes that every trainer rank gets one
    full = {
        f"t{e}_{i}": torch.randn(shape, generator=g) for e in range(m) for i in range(per_engine)
    }

    # When each rank's executor starts and ends, per step (the commit starts at the last end).
    exec_times: dict[tuple[int, int], tuple[float, float]] = {}
    real_run = pipeline.Executor.run
    real_poll = Transport.poll
    real_event = Transport.completion_event
    # Where the write loop's idle slice lives (a module of the pipeline package, or the old
    # single module).
    slice_home: Any = getattr(pipeline, "write", pipeline)
    slice_name = "EVENT_SLICE_S" if hasattr(slice_home, "EVENT_SLICE_S") else "_EVENT_SLICE_S"
    real_slice = getattr(slice_home, slice_name)
    slow = threading.local()

    def timed_run(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        slow.until = time.monotonic() + cfg.data_plane_s
        slow.event = threading.Event()
        timer = threading.Timer(cfg.data_plane_s, slow.event.set)
        timer.start()
        t0 = time.perf_counter()
        try:
            return real_run(self, step, *args, **kwargs)
        finally:
            exec_times[(self.rank, step)] = (t0, time.perf_counter())
            slow.until = 0.0
            timer.cancel()

    def slow_poll(self: Any, handle: Any) -> bool:
        if time.monotonic() < getattr(slow, "until", 0.0):
            return False
        return bool(real_poll(self, handle))

    def slow_event(self: Any, handle: Any) -> Any:
        if time.monotonic() < getattr(slow, "until", 0.0):
            return slow.event
        return real_event(self, handle)

    pipeline.Executor.run = timed_run  # type: ignore[method-assign]
    Transport.poll = slow_poll  # type: ignore[method-assign]
    Transport.completion_event = slow_event  # type: ignore[method-assign]
    # An executor waiting on its writes wakes every 20 ms instead of every 0.1 ms, so that
    # hundreds of them do not take both cores (it still polls the control plane as before).
    setattr(slice_home, slice_name, 0.02)
    undo = _install_counting()
    t_build = time.perf_counter()
    _as("controller", "controller")
    controller = Controller(config.controller_config(n), control)
    receivers: list[Any] = [None] * m
    senders: list[Any] = [None] * n
    errors: list[BaseException] = []

    def make_engine(e: int) -> None:
        _as("engine", f"engine{e}")
        try:
            rng = torch.Generator().manual_seed(10_000 + e)
            receivers[e] = WeightReceiver(
                {f"w{i}": torch.randn(shape, generator=rng) for i in range(per_engine)},
                [identity(f"w{i}", f"t{e}_{i}", shape) for i in range(per_engine)],
                config,
                engine=f"e{e}",
            )
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def make_rank(r: int) -> None:
        _as("controller" if r == 0 else "trainer", f"trainer{r}")
        try:
            senders[r] = WeightSender(
                {k: v.clone() for k, v in full.items()},
                config,
                rank=r,
                world_size=n,
                controller=controller if r == 0 else None,
            )
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    try:
        _join_all([threading.Thread(target=make_engine, args=(e,)) for e in range(m)])
        _join_all([threading.Thread(target=make_rank, args=(r,)) for r in range(n)])
        if errors:
            raise errors[0]
        progress(
            f"  {members} members ({n} trainer ranks, {m} engines) built in "
            f"{time.perf_counter() - t_build:.1f} s"
        )
        steps = cfg.warmups + cfg.updates
        rank_times: dict[tuple[int, int], tuple[float, float]] = {}
        engine_done: dict[tuple[int, int], float] = {}
        stop = threading.Event()
        go = [threading.Barrier(n + 1) for _ in range(steps + 1)]
        idle_until = [0.0]

        def engine_loop(e: int) -> None:
            _as("engine", f"engine{e}")
            for k in range(1, steps + 1):
                try:
                    receivers[e].wait_for_version(k, cfg.timeout_s)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)
                    return
                engine_done[(e, k)] = time.perf_counter()
                if stop.is_set():
                    return

        def rank_loop(r: int) -> None:
            _as("controller" if r == 0 else "trainer", f"trainer{r}")
            for k in range(1, steps + 1):
                go[k].wait()
                t0 = time.perf_counter()
                try:
                    senders[r].update(k)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)
                    return
                rank_times[(r, k)] = (t0, time.perf_counter())

        engines = [threading.Thread(target=engine_loop, args=(e,), daemon=True) for e in range(m)]
        ranks = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(n)]
        for t in engines + ranks:
            t.start()
        # Idle: the engines wait for update 1, nothing else happens.
        time.sleep(0.5)
        COUNTS.reset()
        t_idle = time.perf_counter()
        time.sleep(cfg.idle_s)
        idle_snapshot, _ = COUNTS.snapshot()
        idle_s = time.perf_counter() - t_idle
        idle_until[0] = time.perf_counter()
        per_update: list[dict[str, Any]] = []
        store_cpu0 = None
        for k in range(1, steps + 1):
            if k == cfg.warmups + 1:
                time.sleep(0.2)  # let the engines' acknowledgements of the warm-ups land
                COUNTS.reset()
                cpu0 = time.process_time()
                store_cpu0 = _store_process_cpu_s()
                t_timed = time.perf_counter()
            go[k].wait(cfg.timeout_s)
            deadline = time.monotonic() + cfg.timeout_s
            while time.monotonic() < deadline and not errors:
                if all((r, k) in rank_times for r in range(n)) and all(
                    (e, k) in engine_done for e in range(m)
                ):
                    break
                time.sleep(0.001)
            if errors:
                raise errors[0]
            if k > cfg.warmups:
                starts = [rank_times[(r, k)][0] for r in range(n)]
                ends = [rank_times[(r, k)][1] for r in range(n)] + [
                    engine_done[(e, k)] for e in range(m)
                ]
                exec_start = [exec_times[(r, k)][0] for r in range(n)]
                exec_end = [exec_times[(r, k)][1] for r in range(n)]
                per_update.append(
                    {
                        "update_s": max(ends) - min(starts),
                        "commit_s": max(ends) - max(exec_end),
                        "exec_s": max(exec_end) - min(exec_start),
                        "go_s": max(exec_start) - min(starts),
                    }
                )
        elapsed = time.perf_counter() - t_timed
        cpu = time.process_time() - cpu0
        store_cpu1 = _store_process_cpu_s()
        timed, by_member = COUNTS.snapshot()
        stop.set()
        _join_all(ranks, start=False, timeout_s=cfg.timeout_s)
        _join_all(engines, start=False, timeout_s=cfg.timeout_s)
    finally:
        undo()
        pipeline.Executor.run = real_run  # type: ignore[method-assign]
        Transport.poll = real_poll  # type: ignore[method-assign]
        Transport.completion_event = real_event  # type: ignore[method-assign]
        setattr(slice_home, slice_name, real_slice)
        for s in senders:
            if s is not None:
                s.close()
        for rx in receivers:
            if rx is not None:
                rx.close()
        controller.close(linger_s=0)

    u = cfg.updates
    kinds = ("controller", "trainer", "engine")
    by_kind = {k: sum(v for (kk, _), v in timed.items() if kk == k) / u for k in kinds}
    by_op = collections.Counter[str]()
    for (_, op), v in timed.items():
        by_op[op] += v
    trainer_members = [
        v for k, v in by_member.items() if k.startswith("trainer") and k != "trainer0"
    ]
    engine_members = [v for k, v in by_member.items() if k.startswith("engine")]
    idle_total = sum(idle_snapshot.values())
    return {
        "members": members,
        "trainer_ranks": n,
        "engines": m,
        "updates": u,
        "requests_per_update": sum(timed.values()) / u,
        "requests_per_update_by_kind": by_kind,
        "requests_per_update_by_op": {k: v / u for k, v in sorted(by_op.items())},
        "requests_per_update_per_trainer_rank_max": max(trainer_members, default=0) / u,
        "requests_per_update_per_engine_max": max(engine_members, default=0) / u,
        "requests_per_s_during_updates": sum(timed.values()) / elapsed,
        "idle_requests_per_s": idle_total / idle_s if idle_s else 0.0,
        "idle_requests_per_s_by_kind": {
            k: sum(v for (kk, _), v in idle_snapshot.items() if kk == k) / idle_s for k in kinds
        },
        "update_s": _spread([p["update_s"] for p in per_update]),
        "commit_s": _spread([p["commit_s"] for p in per_update]),
        "go_s": _spread([p["go_s"] for p in per_update]),
        "exec_s": _spread([p["exec_s"] for p in per_update]),
        "process_cpu_s_per_update": cpu / u,
        "store_process_cpu_s_per_update": (
            (store_cpu1 - store_cpu0) / u
            if store_cpu0 is not None and store_cpu1 is not None
            else None
        ),
    }


def _join_all(
    threads: Sequence[threading.Thread], *, start: bool = True, timeout_s: float = 600.0
) -> None:
    if start:
        for t in threads:
            t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        raise TimeoutError(f"{len(hung)} member thread(s) still running after {timeout_s} s")


def machine() -> dict[str, Any]:
    """Where and when this ran, with the load."""
    import torch

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_1_5_15": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def measure_costs(samples: int = 2000) -> dict[str, float]:
    """The simulator's control-plane rates on this machine (`planner.simulate.Rates`):
    `control_rtt_s`, one request's round trip to the store (median of `check` calls), and
    `control_message_s`, the controller's time to authenticate, decrypt and decode one rank's
    report (median). `control_request_s` comes from the cluster runs (store CPU / requests)."""
    from weight_transfer.config import ControlPlaneConfig
    from weight_transfer.control import ControlPlane
    from weight_transfer.planner import codec
    from weight_transfer.protocol import Done

    cfg = ControlPlaneConfig(port=_free_port(), token=secrets.token_hex(16), timeout_s=60)
    server = ControlPlane(cfg, server=True, member="controller")
    try:
        client = ControlPlane(cfg, server=False, member="trainer rank 1")
        client.put("probe", Done(rank=1, step=1, ok=True, error="", nbytes=0, seconds=0.0))
        rtts = []
        for _ in range(samples):
            t0 = time.perf_counter()
            client.exists("probe")
            rtts.append(time.perf_counter() - t0)
        full = client.full_key("done/1/1")
        sealed = client.seal(
            full,
            codec.to_msgpack(Done(rank=1, step=1, ok=True, error="", nbytes=123456, seconds=0.5)),
        )
        costs = []
        for _ in range(samples):
            t0 = time.perf_counter()
            codec.from_msgpack(Done, server.unseal(full, sealed))
            costs.append(time.perf_counter() - t0)
        client.close()
    finally:
        server.close()
    return {
        "control_rtt_s": statistics.median(rtts),
        "control_message_s": statistics.median(costs),
    }


def model(r: dict[str, Any], rates: dict[str, float]) -> dict[str, float] | None:
    """The simulator's control-plane phases for a measured cluster, with the measured rates."""
    try:
        from weight_transfer.planner.simulate import control_plane_phases, rates_from_mapping
    except ImportError:
        return None
    phases = control_plane_phases(r["trainer_ranks"], r["engines"], rates_from_mapping(rates))
    return {
        "go_s": phases["go"],
        "commit_s": phases["done"] + phases["committed"],
        "total_s": sum(phases.values()),
    }


def run(cfg: BenchControlPlaneConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every cluster of `cfg`, one after another, and the costs the simulator takes."""
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "machine_before": machine()}
    out["clusters"] = []
    for members in cfg.members:
        progress(f"cluster of {members} members ...")
        r = run_cluster(members, cfg, progress)
        r["loadavg_after"] = list(os.getloadavg())
        out["clusters"].append(r)
        progress(format_row(r))
    try:
        costs = measure_costs()
    except (ImportError, AttributeError) as exc:  # an older runtime lacks what it needs
        progress(f"costs not measured: {exc}")
        costs = {}
    per_request = [
        r["store_process_cpu_s_per_update"] / r["requests_per_update"]
        for r in out["clusters"]
        if r["store_process_cpu_s_per_update"] is not None and r["requests_per_update"]
    ]
    if per_request:
        costs["control_request_s"] = per_request[-1]  # the largest cluster's
    out["rates"] = costs
    if len(costs) == 3:
        for r in out["clusters"]:
            r["model"] = model(r, costs)
    out["machine_after"] = machine()
    return out


def format_row(r: dict[str, Any]) -> str:
    """One line of the result table."""
    return (
        f"  {r['members']:>4} members ({r['trainer_ranks']}+{r['engines']}): "
        f"{r['requests_per_update']:.0f} requests/update "
        f"(trainer rank <= {r['requests_per_update_per_trainer_rank_max']:.1f}, "
        f"engine <= {r['requests_per_update_per_engine_max']:.1f}), "
        f"idle {r['idle_requests_per_s']:.0f}/s, update {r['update_s']['median'] * 1e3:.1f} ms, "
        f"commit {r['commit_s']['median'] * 1e3:.1f} ms, go {r['go_s']['median'] * 1e3:.1f} ms"
    )


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of `bench control-plane`."""
    p = p or argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--members", default="8,64,384", help="cluster sizes, comma-separated")
    p.add_argument("--updates", type=int, default=10, help="timed updates per cluster")
    p.add_argument("--warmups", type=int, default=2, help="untimed updates first")
    p.add_argument("--idle-s", type=float, default=2.0, help="seconds of idle request counting")
    p.add_argument(
        "--data-plane-s", type=float, default=1.0, help="how long every rank's writes take"
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="every member's timeouts")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")
    return p


def main(ns: argparse.Namespace) -> int:
    """Entry point (namespace from `build_parser`)."""
    try:
        cfg = BenchControlPlaneConfig(
            members=tuple(int(x) for x in ns.members.split(",") if x.strip()),
            updates=ns.updates,
            warmups=ns.warmups,
            idle_s=ns.idle_s,
            data_plane_s=ns.data_plane_s,
            timeout_s=ns.timeout_s,
            json_path=ns.json_path,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run(cfg, progress)
    for r in result["clusters"]:
        print(format_row(r))
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(result, f, indent=2)
        progress(f"wrote {cfg.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
