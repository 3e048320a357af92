"""Many trainer ranks and engines in one process, through the real runtime.

The real `Controller`, `WeightReceiver`s, `WeightSender`s (one thread per trainer rank), planner,
executor, loopback transport and commit protocol run; only what DTensor would tell the sender is
stood in for: each rank's manifest describes the shard boxes the test chose (as
`source_manifest` reports an FSDP2 / 2-D mesh shard), and `full_tensor()` returns the test's
full tensor (what the mesh's all-gather would rebuild). Nothing here computes what an engine
tensor should hold: the tests do that with their own slicing.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from weight_transfer import sender as sender_module
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import (
    ControlPlaneConfig,
    ReceiverConfig,
    SenderConfig,
    TransferConfig,
)
from weight_transfer.controller import Controller
from weight_transfer.manifest import dtype_name
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.types import Box, Recipe, SourceManifest, SourceTensor
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

Shard = tuple[Box | None, tuple[int, ...]]
"""(local box in global coordinates, or None for a shard that is not a box; mesh ranks)."""


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Rows `torch.chunk` (and so FSDP2's Shard(0)) gives chunk `index`: ceil-sized, the last
    ones short or empty."""
    step = -(-size // num_chunks) if size else 0
    return (min(index * step, size), min((index + 1) * step, size))


def fsdp_shards(shape: Sequence[int], world: int) -> list[Shard]:
    """FSDP2 over all ranks: Shard(0) of a 1-D mesh."""
    mesh = tuple(range(world))
    rest = tuple((0, n) for n in shape[1:])
    return [((chunk_bounds(shape[0], world, r), *rest), mesh) for r in range(world)]


def hsdp_shards(shape: Sequence[int], replicas: int, shard: int) -> list[Shard]:
    """A (replicas x shard) mesh with (Replicate(), Shard(0)): rank r holds chunk r % shard."""
    mesh = tuple(range(replicas * shard))
    rest = tuple((0, n) for n in shape[1:])
    return [
        ((chunk_bounds(shape[0], shard, r % shard), *rest), mesh) for r in range(replicas * shard)
    ]


def grid_shards(shape: Sequence[int], rows: int, cols: int) -> list[Shard]:
    """A (rows x cols) mesh with (Shard(0), Shard(last dim)): a block per rank (a 1-D tensor
    gets Shard(0) over the first mesh dimension and is replicated over the second)."""
    mesh = tuple(range(rows * cols))
    out: list[Shard] = []
    for r in range(rows * cols):
        i, j = divmod(r, cols)
        if len(shape) == 1:
            out.append(((chunk_bounds(shape[0], rows, i),), mesh))
        else:
            mid = tuple((0, n) for n in shape[1:-1])
            box = (chunk_bounds(shape[0], rows, i), *mid, chunk_bounds(shape[-1], cols, j))
            out.append((box, mesh))
    return out


def strided_shards(world: int) -> list[Shard]:
    """Shards that are not boxes (FSDP2 + TP's _StridedShard): only a gather rebuilds them."""
    mesh = tuple(range(world))
    return [(None, mesh) for _ in range(world)]


@dataclasses.dataclass
class Engine:
    """One engine rank: its recipes and live tensors (filled with seeded random values)."""

    name: str
    recipes: tuple[Recipe, ...]
    tensors: dict[str, torch.Tensor]


@dataclasses.dataclass
class Outcome:
    """What each trainer rank's thread ended with."""

    results: dict[int, Any]
    """rank -> UpdateStats of the last update, or the exception it raised."""
    seconds: dict[int, float]
    """rank -> seconds its last `update` took."""


class Cluster:
    """A controller, engines and trainer-rank senders in this process (see the module doc).

    Use as a context manager; `update(step)` runs one update on every rank at once.
    """

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        full: Mapping[str, torch.Tensor],
        shards: Mapping[str, Sequence[Shard]],
        engines: Sequence[Engine],
        *,
        world: int,
        backend: str = "loopback",
        timeout_s: float = 30.0,
        memory_budget_bytes: int = 16 << 20,
        task_target_bytes: int = 16 << 20,
        update_timeout_s: float = 30.0,
        wrap: Callable[[WeightSender], None] | None = None,
        receiver: ReceiverConfig | None = None,
    ) -> None:
        self.full = dict(full)
        self.world = world
        self.engines = list(engines)
        self.control = ControlPlaneConfig(
            port=free_port(), token=secrets.token_hex(16), timeout_s=timeout_s
        )
        self.locals: dict[int, dict[str, torch.Tensor]] = {}
        full_of: dict[int, torch.Tensor] = {}
        manifests: dict[int, SourceManifest] = {}
        self._boxes: dict[int, dict[str, Box | None]] = {}
        for r in range(world):
            mine: dict[str, torch.Tensor] = {}
            described = []
            self._boxes[r] = {}
            for name in sorted(self.full):
                box, mesh = shards[name][r]
                t = self.full[name]
                if box is None:
                    local = t.flatten()[r::world].clone()  # some bytes; never read directly
                else:
                    local = t[tuple(slice(a, b) for a, b in box)].clone()
                mine[name] = local
                full_of[id(local)] = t
                self._boxes[r][name] = box
                described.append(
                    SourceTensor(
                        name=name,
                        shape=tuple(t.shape),
                        dtype=dtype_name(t.dtype),
                        local_box=box,
                        mesh=mesh,
                        device="cpu",
                    )
                )
            self.locals[r] = mine
            manifests[r] = SourceManifest(
                rank=r, world_size=world, host="in-process", tensors=tuple(described)
            )

        def source_manifest(tensors: Any, *, rank: int, **_: Any) -> SourceManifest:
            return manifests[rank]

        def full_tensor(t: torch.Tensor, device: Any = None) -> torch.Tensor:
            return full_of[id(t)] if id(t) in full_of else t

        monkeypatch.setattr(sender_module, "source_manifest", source_manifest)
        monkeypatch.setattr(sender_module, "full_tensor", full_tensor)
        config = TransferConfig(
            transport=backend,
            num_engines=len(self.engines),
            control=self.control,
            sender=SenderConfig(update_timeout_s=update_timeout_s),
            receiver=receiver or ReceiverConfig(),
            planner=PlannerConfig(
                memory_budget_bytes=memory_budget_bytes, task_target_bytes=task_target_bytes
            ),
        )
        # Made by hand (not hosted by rank 0's sender): the engines join before any sender.
        self.controller = Controller(config.controller_config(world), self.control)
        self.receivers: list[WeightReceiver] = []
        self.senders: dict[int, WeightSender] = {}
        try:
            for e in self.engines:
                self.receivers.append(WeightReceiver(e.tensors, e.recipes, config, engine=e.name))

            def build(r: int) -> WeightSender:
                s = WeightSender(
                    self.locals[r],
                    config,
                    rank=r,
                    world_size=world,
                    controller=self.controller if r == 0 else None,
                )
                if wrap is not None:
                    wrap(s)
                return s

            built = self._on_every_rank(build, timeout_s + 30)
            for r, s in built.results.items():
                if isinstance(s, BaseException):
                    raise s
                self.senders[r] = s
        except BaseException:
            self.close()
            raise

    def refresh_locals(self) -> None:
        """Copy the (changed) full tensors into every rank's shards, as an optimizer step would."""
        for r, mine in self.locals.items():
            for name, local in mine.items():
                box = self._boxes[r][name]
                if box is not None:
                    local.copy_(self.full[name][tuple(slice(a, b) for a, b in box)])

    def update(self, step: int, timeout_s: float = 60.0) -> Outcome:
        """`WeightSender.update(step)` on every rank at once."""
        return self._on_every_rank(lambda r: self.senders[r].update(step), timeout_s)

    def _on_every_rank(self, fn: Callable[[int], Any], timeout_s: float) -> Outcome:
        results: dict[int, Any] = {}
        seconds: dict[int, float] = {}

        def body(r: int) -> None:
            import time

            t0 = time.monotonic()
            try:
                results[r] = fn(r)
            except BaseException as exc:  # handed to the test
                results[r] = exc
            seconds[r] = time.monotonic() - t0

        threads = [
            threading.Thread(target=body, args=(r,), name=f"trainer-{r}", daemon=True)
            for r in range(self.world)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        assert not hung, f"trainer rank(s) {hung} still running after {timeout_s} s"
        return Outcome(results, seconds)

    def close(self) -> None:
        """Close every sender, receiver and the controller."""
        for s in self.senders.values():
            s.close()
        for rx in self.receivers:
            rx.close()
        self.controller.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
