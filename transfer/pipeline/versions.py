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
    WriteOp,
)


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

    def write(self, step: int, timeout_s: float) -> None:
        """Write `step` into every engine's version word; blocks until all landed."""
        if not self.engines:
            return
        self._buf.fill_(step)
        handles = []
        for i, e in enumerate(self.engines):
            vdesc = self.descriptors[e][self.version_regions[e]]
            handles.append(
                self.transport.post_writes(e, [WriteOp(self.region, i * 8, vdesc, 0, 8)])
            )
        for h in handles:
            self.transport.wait(h, timeout_s)
