"""Engine side: register the engine's live tensors once, publish them, then stay passive."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import nn

from weight_transfer.backends.base import (
    ConfigurationError,
    Region,
    RegionRole,
    Transport,
    TransportConfig,
    TransportTimeoutError,
    WeightTransferError,
    create_transport,
)
from weight_transfer.config import ControlPlaneConfig, ReceiverConfig, TransferConfig
from weight_transfer.control import ControlPlane
from weight_transfer.errors import UpdateFailedError
from weight_transfer.layouts import Layout
from weight_transfer.manifest import distinct_storages, dtype_name, named_tensors, storage_view
from weight_transfer.planner.types import DestManifest, DestRegion, DestTensor, Recipe
from weight_transfer.protocol import Claim, Decision, Digests, EngineJoin, Seen

log = logging.getLogger(__name__)

_DECISION_POLL_S = 0.05


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (dtype-agnostic, bit-exact)."""
    data = t.detach().contiguous().cpu().view(-1).view(torch.uint8)
    return hashlib.sha256(ctypes.string_at(data.data_ptr(), data.numel())).hexdigest()


class WeightReceiver:
    """Exposes an engine's tensors to one-sided writes; runs no code per update.

    Construction registers the memory of every tensor the recipes write (whole storages, in
    place: CUDA graphs that captured these addresses stay valid), allocates the 8-byte version
    word and publishes the destination manifest and transport endpoint on the control plane.
    After that the engine only reads `version` / `wait_for_version` to learn that update k is
    complete; the transport's own machinery (NIC, shared memory, receive thread of the `tcp`
    simulator) does the rest.

    Not thread-safe; `version` and `wait_for_version` may be called from any thread.
    """

    def __init__(
        self,
        tensors: nn.Module | Mapping[str, torch.Tensor],
        layout: Layout | Sequence[Recipe],
        config: TransferConfig,
        *,
        engine: str,
        rejoin: bool = False,
        transport: TransportConfig | None = None,
    ) -> None:
        """Register and publish.

        Args:
            tensors: the engine's live parameters (module) or a name -> tensor mapping.
            layout: how each engine tensor is built: a layout (`VllmLayout`, or anything with
                `recipes`) or the recipes themselves (the engine's own).
            config: the transfer's configuration (control plane, transport, receiver settings).
            engine: unique name of this engine rank ("engine0", "replica1/tp3").
            rejoin: this engine restarted (new memory, new registrations) under a name that
                joined before; the trainers use it after their next `WeightSender.replan`.
            transport: this process's `TransportConfig`, for settings the config file does
                not carry per process (a listen address of its own); default:
                `config.transport_config()`.

        Raises:
            ConfigurationError: a recipe names a missing tensor, a tensor is not contiguous, a
                tensor no recipe writes (unless allowed), the engine name is taken (or, with
                `rejoin`, was never registered).
        """
        recipes = layout.recipes if isinstance(layout, Layout) else layout
        control = config.control
        if transport is None:
            transport = config.transport_config()
        self.engine = engine
        self.config: ReceiverConfig = config.receiver
        """This receiver's own settings (`config.receiver`)."""
        self.recipes = tuple(recipes)
        self._tensors = named_tensors(tensors)
        self._check_tensors()
        self._known_complete = 0  # newest version whose commit the controller confirmed
        self._control = ControlPlane(control, server=False, member=f"engine {engine!r}")
        first, _ = self._control.claim(
            f"engine/{engine}", Claim(member=f"engine {engine!r}", nonce=os.urandom(16))
        )
        if rejoin and first:
            raise ConfigurationError(
                f"engine {engine!r} cannot rejoin: it never joined this control plane session"
            )
        if not rejoin and not first:
            raise ConfigurationError(
                f"engine {engine!r} is already registered with this control plane session "
                "(a restarted engine passes rejoin=True)"
            )
        self._transport: Transport = create_transport(transport)
        try:
            self._manifest = self._register()
            self._publish_join()
        except BaseException:
            self._transport.close()
            raise
        log.info(
            "engine %s: registered %d tensors in %d regions over %s",
            engine,
            len(self._manifest.tensors),
            len(self._manifest.regions),
            self._transport.name,
        )

    def _publish_join(self) -> None:
        """Claim the next free join slot and publish the manifest and endpoint in it."""
        slot = 0
        while not self._control.claim(
            f"engine_slot/{slot}", Claim(member=f"engine {self.engine!r}", nonce=os.urandom(16))
        )[0]:
            slot += 1
        self._control.put(
            f"engine_slot/{slot}",
            EngineJoin(
                manifest=self._manifest,
                transport=self._transport.name,
                endpoint=self._transport.endpoint(),
            ),
        )

    def join_new_session(self, control: ControlPlaneConfig | None = None) -> None:
        """Join the control plane of a restarted controller, keeping memory and registrations.

        When the controller (and with it usually the trainer job) restarts, it hosts a new
        session with a new run id; a running engine calls this once (after `wait_for_version`
        raised `PeerLostError`, say) instead of restarting: it connects to `control` (default:
        the same address and token), claims its name there and publishes its unchanged
        manifest and endpoint. The new trainers plan and connect as on a first start. Its
        version word keeps the last update it received, so the new trainer job should continue
        counting steps from there.

        Raises:
            TransportTimeoutError: the new control plane did not answer in time.
            ConfigurationError: the engine's name is already registered in that session (the
                controller did not restart: use `WeightSender.replan` with `rejoined`).
        """
        config = control or self._control.config
        # The old session's results are gone with it: what the word reads now is what this
        # engine last received.
        self._known_complete = self.version
        self._control.close()
        self._control = ControlPlane(config, server=False, member=f"engine {self.engine!r}")
        first, _ = self._control.claim(
            f"engine/{self.engine}", Claim(member=f"engine {self.engine!r}", nonce=os.urandom(16))
        )
        if not first:
            raise ConfigurationError(
                f"engine {self.engine!r} is already registered in that control plane session "
                "(the controller did not restart; a restarted engine passes rejoin=True)"
            )
        self._publish_join()
        log.info(
            "engine %s: joined a new control plane session (version %d)", self.engine, self.version
        )

    # -- setup -----------------------------------------------------------------------------

    def _written_names(self) -> set[str]:
        names = set()
        for r in self.recipes:
            names.add(r.dest)
            if r.quant is not None:
                names.add(r.quant.scale_dest)
        return names

    def _check_tensors(self) -> None:
        problems = []
        written = self._written_names()
        for name in sorted(written - set(self._tensors)):
            problems.append(f"recipe writes engine tensor {name!r}, which the engine does not have")
        if not self.config.allow_unwritten:
            for name in sorted(set(self._tensors) - written):
                problems.append(f"engine tensor {name!r} is written by no recipe")
        for name in sorted(written & set(self._tensors)):
            t = self._tensors[name]
            if not t.is_contiguous():
                problems.append(f"engine tensor {name!r} is not contiguous")
            if t.device.type not in ("cpu", "cuda"):
                problems.append(f"engine tensor {name!r} is on unsupported device {t.device}")
        if problems:
            raise ConfigurationError(f"engine {self.engine!r}: " + "; ".join(problems))

    def _register(self) -> DestManifest:
        names = sorted(self._written_names())
        tensors = [self._tensors[n] for n in names]
        storages = distinct_storages(tensors)
        self._regions: list[Region] = []
        index_of: dict[tuple[str, int], int] = {}
        for i, s in enumerate(storages):
            dev = next(t.device for t in tensors if t.untyped_storage().data_ptr() == s.data_ptr())
            key = (str(dev), s.data_ptr())
            region = self._transport.register(storage_view(s, dev), role=RegionRole.TARGET)
            self._regions.append(region)
            index_of[key] = i
        dests = []
        for n in names:
            t = self._tensors[n]
            # Registration may have moved the storage in place (loopback host memory): re-read.
            s = t.untyped_storage()
            idx = None
            for i, r in enumerate(self._regions):
                if (
                    r.tensor.untyped_storage().data_ptr() == s.data_ptr()
                    and r.tensor.device == t.device
                ):
                    idx = i
                    break
            assert idx is not None, f"storage of {n} not registered"
            dests.append(
                DestTensor(
                    name=n,
                    shape=tuple(int(x) for x in t.shape),
                    dtype=dtype_name(t.dtype),
                    region=idx,
                    # Eager tensors have int offsets; the stubs also allow SymInt (tracing).
                    offset_bytes=cast(int, t.storage_offset()) * t.element_size(),
                )
            )
        self._version = torch.zeros(1, dtype=torch.int64)
        vregion = self._transport.register(self._version, role=RegionRole.TARGET)
        # The transport may have moved it into shared memory: keep the registered view.
        self._version_view = vregion.tensor.view(torch.int64)
        self._regions.append(vregion)
        regions = tuple(
            DestRegion(index=i, nbytes=r.nbytes, descriptor=r.descriptor.to_bytes())
            for i, r in enumerate(self._regions)
            if r.descriptor is not None
        )
        return DestManifest(
            engine=self.engine,
            host=socket.gethostname(),
            regions=regions,
            tensors=tuple(dests),
            recipes=self.recipes,
            version_region=len(self._regions) - 1,
        )

    # -- what the engine calls ---------------------------------------------------------------

    @property
    def manifest(self) -> DestManifest:
        """The destination manifest this receiver published."""
        return self._manifest

    @property
    def version(self) -> int:
        """This rank's version word: the last update completely written into it (0 before
        any). While update k commits, one rank of a replica can read k an instant before
        another, and a commit that fails is set back to k-1; `wait_for_version` returns only
        updates whose words were written on every engine."""
        return int(self._version_view[0].item())

    def wait_for_version(self, step: int, timeout_s: float) -> int:
        """Block until update `step` (or a later one) is complete; returns the version seen.

        While waiting it also watches the control plane (every `_DECISION_POLL_S`), so a failed
        update is reported here as soon as the controller decides it, with the controller's
        message naming the failed rank or peer.

        Raises:
            TransportTimeoutError: not reached within `timeout_s`.
            UpdateFailedError: the controller aborted update `step` (this engine's version
                did not advance; the trainers may retry with a later step).
            PeerLostError: the controller is gone.
        """
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic()
        while True:
            v = self.version
            if v >= step and self._confirmed(v, step):
                return v
            if time.monotonic() >= next_check:
                self._raise_if_aborted(step)
                next_check = time.monotonic() + _DECISION_POLL_S
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"engine {self.engine!r}: update {step} not complete after {timeout_s:.1f} s "
                    f"(version is {v})"
                )
            time.sleep(0.0005)

    def _confirmed(self, v: int, step: int) -> bool:
        """True once the controller's result for update `v` says every version word was
        written; raises if it says the update failed (its words are being set back)."""
        if v <= self._known_complete:
            return True
        if not self._control.exists(f"result/{v}"):
            time.sleep(0.0005)
            return False
        decision = self._control.get(f"result/{v}", Decision)
        if not decision.ok:
            raise UpdateFailedError(
                f"engine {self.engine!r}: update {v} failed while its version words were "
                f"written and is rolled back (waiting for {step}): {decision.error}",
                step=v,
            )
        self._known_complete = v
        try:
            # Lets a trainer job that is ending keep the control plane up until its engines
            # have seen the last update complete (`Controller.close`).
            self._control.put(f"seen/{self.engine}", Seen(engine=self.engine, step=v))
        except WeightTransferError as exc:
            log.debug("engine %r: could not acknowledge update %d: %s", self.engine, v, exc)
        return True

    def _raise_if_aborted(self, step: int) -> None:
        for key in (f"commit/{step}", f"result/{step}"):
            if self._control.exists(key):
                decision = self._control.get(key, Decision)
                if not decision.ok:
                    raise UpdateFailedError(
                        f"engine {self.engine!r}: update {step} failed and was not applied "
                        f"(version stays {self.version}): {decision.error}",
                        step=step,
                    )

    def tensor(self, name: str) -> torch.Tensor:
        """The live engine tensor `name`."""
        return self._tensors[name]

    def digests(self) -> dict[str, str]:
        """sha256 of every written tensor's bytes (verification mode; costs one read of all)."""
        out = {}
        for t in self._manifest.tensors:
            out[t.name] = tensor_digest(self._tensors[t.name])
        return out

    def publish_digests(self, step: int) -> None:
        """Publish `digests()` for update `step` so the trainer side can verify it."""
        d = self.digests()
        self._control.put(
            f"digest/{step}/{self.engine}",
            Digests(
                engine=self.engine,
                step=step,
                version=self.version,
                digests=tuple(sorted(d.items())),
            ),
        )

    def close(self) -> None:
        """Deregister everything and close the transport. The tensors stay valid."""
        self._transport.close()
        self._control.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
