"""A plan refused for a mismatched source: every trainer process raises the same list, even when
the process hosting the control plane exits the moment it raised (issue 23)."""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from typing import Any

import pytest
import torch

from weight_transfer.cli.launch import Child, Launch
from weight_transfer.cli.run_demo import free_port

WANT = [
    "trainer tensor 'a.weight' is shape (41, 19), but engine 'e0' reads it for 'a.weight' as "
    "shape (37, 19)"
]


def _control(port: int, token: str) -> Any:
    from weight_transfer.config import ControlPlaneConfig

    return ControlPlaneConfig(port=port, token=token, timeout_s=30)


def trainer_proc(rank: int, port: int, token: str, out: Any) -> None:
    """Rank 0 hosts the controller; both hold an `a.weight` wider than the engine expects.
    Reports what it raised and exits at once (rank 0's store goes with it)."""
    from weight_transfer.config import TransferConfig
    from weight_transfer.sender import WeightSender

    src = {"a.weight": torch.randn(41, 19), "b.weight": torch.randn(5)}
    try:
        # Rank 0's sender hosts the controller, and closes it when the plan fails.
        WeightSender(
            src,
            TransferConfig(num_engines=1, control=_control(port, token)),
            rank=rank,
            world_size=2,
        )
    except Exception as exc:
        out.put((rank, type(exc).__name__, list(getattr(exc, "problems", [str(exc)]))))
        return
    out.put((rank, "no error", []))


def engine_proc(port: int, token: str, done: Any, out: Any) -> None:
    from weight_transfer.config import TransferConfig
    from weight_transfer.planner.recipes import column_shard, identity
    from weight_transfer.receiver import WeightReceiver

    recipes = (
        column_shard("a.weight", "a.weight", (37, 19), tp_rank=0, tp_size=1),
        identity("b.weight", "b.weight", (5,)),
    )
    g = torch.Generator().manual_seed(5)
    tensors = {
        "a.weight": torch.randn(37, 19, generator=g),
        "b.weight": torch.randn(5, generator=g),
    }
    before = {n: t.clone() for n, t in tensors.items()}
    rx = WeightReceiver(
        tensors, recipes, TransferConfig(control=_control(port, token)), engine="e0"
    )
    done.wait(60)
    unchanged = all(torch.equal(tensors[n], before[n]) for n in tensors)
    out.put(("engine", rx.version, unchanged))
    rx.close()


@pytest.mark.timeout(120)
def test_every_rank_raises_the_mismatch_even_when_the_controller_exits_at_once() -> None:
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    port, token = free_port(), secrets.token_hex(16)
    launch = Launch(
        [
            *(Child(f"trainer{r}", trainer_proc, (r, port, token)) for r in (0, 1)),
            Child("engine", engine_proc, (port, token, done)),
        ]
    )
    reports: dict[Any, Any] = {}
    deadline = time.monotonic() + 90
    try:
        launch.start()
        while len(reports) < 3 and time.monotonic() < deadline:
            got = launch.get(timeout_s=0.2)
            if got is not None:
                msg = got[1]
                reports[msg[0]] = tuple(msg[1:])
            elif launch.failure() is not None:
                break
            if 0 in reports and 1 in reports:
                done.set()
    finally:
        done.set()
        codes = launch.close(grace_s=30)
    assert codes == dict.fromkeys(launch.names, 0), (codes, reports, launch.tracebacks)
    assert reports[0] == ("PlanMismatchError", WANT), reports
    assert reports[1] == ("PlanMismatchError", WANT), reports
    assert reports["engine"] == (0, True)  # nothing written, version 0
