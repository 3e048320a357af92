"""The version commit: one 8-byte write of the update's number into each engine's version word.

It runs only after every rank's writes of the update completed (the sender's commit phase), so
an engine that reads its word never sees an update whose bytes are still in flight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weight_transfer.backends.base import (
    Region,
    RegionDescriptor,
    RegionRole,
    Transport,
    WriteHandle,
    WriteOp,
)

QUIESCE_S = 1.0
"""After a failed version write, longest the writer waits for it to settle."""


class VersionWriter:
    """Writes the version words of the engines this rank commits (`version_engines`)."""

    def __init__(
        self,
        transport: Transport,
        engines: Sequence[str],
        descriptors: Mapping[str, Sequence[RegionDescriptor]],
        version_regions: Mapping[str, int],
    ) -> None:
        self.transport = transport
        self.engines = tuple(engines)
        self.descriptors = descriptors
        self.version_regions = version_regions
        """Per engine, the index of its version-word region among its descriptors."""
        self._buf = torch.zeros(max(1, len(self.engines)), dtype=torch.int64)
        self.region: Region = transport.register(self._buf, role=RegionRole.SOURCE)
        self._unsettled: list[WriteHandle] = []
        """Version writes of a failed commit that may still read `_buf`."""
        self.retired: list[Region] = []
        """Buffers given up because a failed write might still read them (kept registered)."""

    def write(self, step: int, timeout_s: float) -> None:
        """Write `step` into every engine's version word; blocks until all landed.

        After a failed write the buffer is reused only once that write settled: a roll-back
        must not be overwritten by a late read of the word it replaces. A write that never
        settles leaves its buffer registered and unused; a fresh one takes its place.
        """
        if not self.engines:
            return
        self._retire_if_read()
        self._buf.fill_(step)
        handles = []
        try:
            for i, e in enumerate(self.engines):
                vdesc = self.descriptors[e][self.version_regions[e]]
                handles.append(
                    self.transport.post_writes(e, [WriteOp(self.region, i * 8, vdesc, 0, 8)])
                )
            for h in handles:
                self.transport.wait(h, timeout_s)
        except BaseException:
            for h in handles:
                self.transport.quiesce(h, QUIESCE_S)
            self._unsettled = [h for h in handles if not h.settled]
            raise

    def _retire_if_read(self) -> None:
        """Swap in a fresh buffer if a failed write may still read the current one."""
        for h in self._unsettled:
            self.transport.quiesce(h, 0.0)
        if all(h.settled for h in self._unsettled):
            self._unsettled = []
            return
        self.retired.append(self.region)
        self._buf = torch.zeros_like(self._buf)
        self.region = self.transport.register(self._buf, role=RegionRole.SOURCE)
        self._unsettled = []
