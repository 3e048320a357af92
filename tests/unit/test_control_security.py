"""Control plane security: token required, values encrypted and authenticated, no pickle, the
store bound to the configured interface only, memory keys readable only by members."""

from __future__ import annotations

import ast
import datetime
import secrets
import time
from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from weight_transfer.backends.base import ControlPlaneAuthError
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import ControllerConfig, ControlPlaneConfig, TransferConfig
from weight_transfer.control import ControlPlane, derive_key
from weight_transfer.controller import Controller
from weight_transfer.planner import codec
from weight_transfer.planner.recipes import identity
from weight_transfer.protocol import Decision
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

ROOT = Path(__file__).resolve().parents[2]


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of LISTEN sockets on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, p = fields[1].split(":")
            if int(p, 16) == port and fields[3] == "0A":  # 0A = LISTEN
                found.append(addr)
    return found


def _raw_client(port: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5), use_libuv=True
    )


def test_token_is_required() -> None:
    with pytest.raises(ValueError, match="token"):
        ControlPlaneConfig(token="")
    with pytest.raises(ValueError, match="token"):
        ControlPlaneConfig(token="short")


def test_store_binds_only_the_configured_host() -> None:
    cp = ControlPlaneConfig(host="127.0.0.1", port=free_port(), token=secrets.token_hex(16))
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    try:
        addrs = _listening_addresses(cp.port)
        # 0100007F is 127.0.0.1 in /proc/net/tcp's little-endian hex; never 0.0.0.0 or ::.
        assert addrs == ["0100007F"], addrs
    finally:
        ctrl.close()


@pytest.mark.timeout(60)
def test_outsider_reads_only_ciphertext_and_cannot_forge() -> None:
    token = secrets.token_hex(16)
    cp = ControlPlaneConfig(port=free_port(), token=token, timeout_s=10)
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    g = torch.Generator().manual_seed(1)
    engine_tensors = {"secret_tensor_name.weight": torch.randn(8, 4, generator=g)}
    cfg = TransferConfig(transport="tcp", control=cp)
    rx = WeightReceiver(
        engine_tensors,
        [identity("secret_tensor_name.weight", "secret_tensor_name.weight", (8, 4))],
        cfg,
        engine="e0",
    )
    src = {"secret_tensor_name.weight": torch.randn(8, 4, generator=g)}
    tx = WeightSender(src, cfg, controller=ctrl)
    try:
        outsider = _raw_client(cp.port)
        descriptors = [r.descriptor for r in rx.manifest.regions]
        endpoint = rx._transport.endpoint()
        for key in ("hello", "trainer/0", "engine_slot/0", "schedule/0"):
            raw = outsider.get(f"wt/default/{key}")
            assert b"secret_tensor_name" not in raw, key
            assert not any(d in raw for d in descriptors), f"{key} exposes a memory key"
            assert endpoint not in raw, key
            with pytest.raises(ValueError):
                codec.from_msgpack(Decision, raw)  # no structure visible to decode
            # A guessed token does not open it either.
            wrong = AESGCM(derive_key(secrets.token_hex(16), "default", ctrl.control.run_id))
            with pytest.raises(InvalidTag):
                wrong.decrypt(
                    raw[:12], raw[12:], ctrl.control.run_id + f"wt/default/{key}".encode()
                )
        # Forge "update 1 committed" as an outsider: every member refuses it.
        forged = codec.to_msgpack(Decision(step=1, ok=True, error=""))
        outsider.set("wt/default/commit/1", forged + b"\0" * 28)
        with pytest.raises(ControlPlaneAuthError, match="failed authentication"):
            ctrl.control.get("commit/1", Decision, 1)
        # ...nor can a valid value be moved to another key.
        ctrl.control.put("result/5", Decision(step=5, ok=False, error="x"))
        outsider.set("wt/default/result/6", outsider.get("wt/default/result/5"))
        with pytest.raises(ControlPlaneAuthError):
            ctrl.control.get("result/6", Decision, 1)
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_wrong_token_member_is_refused_on_join() -> None:
    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=5)
    server = ControlPlane(cp, server=True, member="controller")
    try:
        bad = ControlPlaneConfig(port=cp.port, token=secrets.token_hex(16), timeout_s=5)
        with pytest.raises(ControlPlaneAuthError, match="do not share this token"):
            ControlPlane(bad, server=False, member="intruder")
    finally:
        server.close()


def test_no_pickle_in_library_code() -> None:
    """No module of the library imports pickle (or its relatives) for anything on a wire."""
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    offenders = []
    for pkg in ("planner", "transfer", "backends"):
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module.split(".")[0]]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in banned]
    assert not offenders, offenders


def test_sealed_values_are_not_plain_msgpack() -> None:
    cp = ControlPlane(
        ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16)),
        server=True,
        member="controller",
    )
    try:
        sealed = cp.seal("wt/default/k", codec.to_msgpack(Decision(step=1, ok=True, error="")))
        try:
            obj = msgpack.unpackb(sealed[12:], raw=False)
        except Exception:  # noqa: BLE001 - any decode failure is the point
            obj = None
        assert obj != {"step": 1, "ok": True, "error": ""}
    finally:
        cp.close()


# -- replay across runs, and strangers on the port ----------------------------------------------


@pytest.mark.timeout(60)
def test_a_value_recorded_in_an_earlier_run_is_refused() -> None:
    """Same token, same session, same port, a new controller: a `commit/1` that said ok in run
    1 does not authenticate in run 2 (fresh run id in the key and in every value's AAD), and
    neither does run 1's `hello` planted before run 2's members join."""
    token, port = secrets.token_hex(16), free_port()
    cfg = ControlPlaneConfig(port=port, token=token, timeout_s=5)
    run1 = ControlPlane(cfg, server=True, member="controller (run 1)")
    run1.put("commit/1", Decision(step=1, ok=True, error=""))
    outsider = _raw_client(port)
    recorded = {k: outsider.get(f"wt/default/{k}") for k in ("commit/1", "hello")}
    member1 = ControlPlane(cfg, server=False, member="trainer rank 1")
    assert member1.get("commit/1", Decision).ok  # genuine in its own run
    del outsider, member1
    run1._store = None  # the first controller ends; its store goes with the object
    run1.close()
    import gc

    gc.collect()
    run2 = ControlPlane(cfg, server=True, member="controller (run 2)")
    try:
        assert run2.run_id != run1.run_id
        outsider = _raw_client(port)
        outsider.set("wt/default/commit/1", recorded["commit/1"])
        member = ControlPlane(cfg, server=False, member="trainer rank 1")
        with pytest.raises(ControlPlaneAuthError, match="another run"):
            member.get("commit/1", Decision, 1)
        # The old hello replayed: a member that joins now takes run 1's id and fails on its
        # first read of a run-2 value instead of accepting anything recorded.
        run2.put("go/1", Decision(step=1, ok=True, error=""))
        outsider.set("wt/default/hello", recorded["hello"])
        late = ControlPlane(cfg, server=False, member="engine 'e9'")
        assert late.run_id == run1.run_id
        with pytest.raises(ControlPlaneAuthError):
            late.get("go/1", Decision, 1)
    finally:
        run2.close()


@pytest.mark.timeout(60)
def test_stranger_cannot_pre_claim_an_engine_name_or_stall_a_join() -> None:
    # A plan that waited on the forged slot would wait out the control plane's timeout (30 s);
    # the bound below is half that, far above a sender's construction on a loaded machine
    # (0.1-0.4 s here; 5.2 s once in CI under memory pressure, touching its 512 MiB staging).
    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=30)
    ctrl = Controller(ControllerConfig(num_trainer_ranks=1, num_engines=1), cp)
    rx = tx = None
    try:
        outsider = _raw_client(cp.port)
        outsider.set("wt/default/claim/engine/e0", b"x" * 40)
        g = torch.Generator().manual_seed(2)
        tensors = {"w": torch.randn(4, 4, generator=g)}
        with pytest.raises(ControlPlaneAuthError, match="claim/engine/e0"):
            WeightReceiver(
                tensors, [identity("w", "w", (4, 4))], TransferConfig(control=cp), engine="e0"
            )
        # A forged join slot is nobody's: the engine and the controller skip it (they used
        # to stop at it, the engine raising and the controller waiting out its timeout).
        outsider.set("wt/default/claim/engine_slot/0", b"y" * 40)
        rx = WeightReceiver(
            tensors, [identity("w", "w", (4, 4))], TransferConfig(control=cp), engine="e1"
        )
        src = {"w": torch.randn(4, 4, generator=g)}
        t0 = time.monotonic()
        tx = WeightSender(src, TransferConfig(control=cp), controller=ctrl)
        assert time.monotonic() - t0 < 15, "the plan waited for the forged slot"
        assert sorted(ctrl.joins) == ["e1"]
        tx.update(1)
        assert rx.wait_for_version(1, 5) == 1
        assert torch.equal(rx.tensor("w"), src["w"])
    finally:
        for m in (tx, rx):
            if m is not None:
                m.close()
        ctrl.close()


@pytest.mark.timeout(60)
def test_stranger_cannot_release_a_barrier_early() -> None:
    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=5)
    server = ControlPlane(cp, server=True, member="controller")
    try:
        outsider = _raw_client(cp.port)
        outsider.set("wt/default/barrier/group/1/1/1", b"z" * 40)  # "rank 1 arrived"
        with pytest.raises(ControlPlaneAuthError, match="barrier/group/1/1/1"):
            server.barrier("group/1/1", 2, 0, timeout_s=2)
        # Without the forgery, a missing member is a timeout that names it.
        with pytest.raises(Exception, match=r"barrier/group/2/1/1"):
            server.barrier("group/2/1", 2, 0, timeout_s=0.5)
    finally:
        server.close()
