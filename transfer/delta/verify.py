"""Delta verification (`DeltaConfig.verify`): every engine's bytes against what the trainer
ranks sent, by keyed position digests, without full tensors anywhere.

Per update the controller's rank draws a secret key (`request`); after applying, each engine
publishes one `weight_transfer.verify.position_digest` of every byte its recipes write
(`WeightReceiver.apply_delta`); each trainer rank publishes the digest of its own runs, from its
snapshot (`publish`). The digest is linear in the bytes and keyed by absolute position, so the
writers' digests of an engine add up to the engine's exactly when the bytes agree. The
controller's rank compares at the start of the next update and publishes a verdict every rank
reads (`judge`). Keys are deleted 8 updates later by whoever wrote them.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence

import torch

from weight_transfer.backends.base import WeightTransferError
from weight_transfer.control import ControlPlane
from weight_transfer.delta.patch import (
    engine_digest_key,
    rank_digest_key,
    verdict_key,
    verify_key_key,
)
from weight_transfer.protocol import Decision, Digests
from weight_transfer.verify import name_key, position_digest, region_position

log = logging.getLogger(__name__)

_M64 = (1 << 64) - 1
_KEEP_UPDATES = 8


class DeltaVerifier:
    """One trainer rank's part of delta verification (module docstring). Not thread-safe."""

    def __init__(
        self,
        *,
        rank: int,
        control: ControlPlane,
        writers: Mapping[str, Sequence[int]] | None,
        timeout_s: float,
    ) -> None:
        """`writers` (engine -> trainer ranks writing it) on the controller's rank only: it
        draws the keys and judges."""
        self.rank = rank
        self.control = control
        self.writers = dict(writers) if writers is not None else None
        self.timeout_s = timeout_s
        self._pending = 0  # committed update whose digests were published, not yet judged
        self._published: list[list[str]] = []

    def request(self, step: int) -> None:
        """Before update `step` writes anything: the controller's rank draws its key."""
        if self.writers is None:
            return
        self.control.put(
            verify_key_key(step),
            Digests(
                engine="key", step=step, version=0, digests=(("key", str(secrets.randbits(62))),)
            ),
        )

    def publish(
        self,
        step: int,
        engines: Sequence[str],
        runs: Sequence[tuple[str, int, int, torch.Tensor]],
    ) -> None:
        """After update `step` committed: this rank's digest of each of `engines` (its peers:
        0 where it wrote none of their bytes), from `runs` (engine, region, offset in the
        region, the bytes it sent there)."""
        key = int(dict(self.control.get(verify_key_key(step), Digests).digests)["key"])
        sums = dict.fromkeys(engines, 0)
        for peer, region, offset, data in runs:
            sums[peer] = sums.get(peer, 0) + position_digest(
                data, region_position(region, offset), key ^ name_key(peer)
            )
        self._forget([rank_digest_key(step, peer, self.rank) for peer in sums])
        for peer, total in sums.items():
            self.control.put(
                rank_digest_key(step, peer, self.rank),
                Digests(engine=peer, step=step, version=0, digests=(("sum", str(total & _M64)),)),
            )
        self._pending = step

    def judge(self, deadline: float) -> None:
        """Judge the last published update (if any): the controller's rank compares and
        publishes the verdict, every rank reads it.

        Raises:
            WeightTransferError: an engine's bytes differ from what its writers sent (named).
        """
        step, self._pending = self._pending, 0
        if not step:
            return
        timeout = max(0.001, min(deadline - time.monotonic(), self.timeout_s))
        if self.writers is not None:
            bad = []
            for engine, ranks in sorted(self.writers.items()):
                got = self.control.get(engine_digest_key(step, engine), Digests, timeout)
                total = 0
                for r in ranks:
                    part = self.control.get(rank_digest_key(step, engine, r), Digests, timeout)
                    total += int(dict(part.digests)["sum"])
                if int(dict(got.digests)["sum"]) != total & _M64:
                    bad.append(engine)
            error = (
                f"engine(s) {', '.join(bad[:10])} hold bytes that differ from what the trainer "
                "ranks sent"
                if bad
                else ""
            )
            self.control.put(verdict_key(step), Decision(step=step, ok=not bad, error=error))
            self._forget([verdict_key(step), verify_key_key(step)])
        verdict = self.control.get(verdict_key(step), Decision, timeout)
        if not verdict.ok:
            raise WeightTransferError(
                f"trainer rank {self.rank}: delta verification of update {step}: {verdict.error}"
            )
        log.info("trainer rank %d: update %d verified", self.rank, step)

    def _forget(self, keys: list[str]) -> None:
        """Delete the keys this rank made `_KEEP_UPDATES` updates ago (bounded store)."""
        self._published.append(keys)
        while len(self._published) > _KEEP_UPDATES:
            for k in self._published.pop(0):
                try:
                    self.control.delete(k)
                except WeightTransferError as exc:  # only costs store memory
                    log.debug("trainer rank %d: could not delete %r: %s", self.rank, k, exc)


__all__ = ["DeltaVerifier"]
