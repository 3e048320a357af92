"""Engine side: register the engine's live tensors once, publish them, then stay passive."""

from __future__ import annotations

import ctypes
import dataclasses
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
    ControlPlaneAuthError,
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
from weight_transfer.delta.patch import (
    HEADER_BYTES,
    ApplyStats,
    PatchError,
    applied_key,
    apply_patch_region,
    engine_digest_key,
    verify_key_key,
)
from weight_transfer.errors import UpdateFailedError
from weight_transfer.kernels.delta import use_kernels
from weight_transfer.layouts import Layout
from weight_transfer.manifest import distinct_storages, dtype_name, named_tensors, storage_view
from weight_transfer.planner.types import (
    DestManifest,
    DestRegion,
    DestTensor,
    Recipe,
    dtype_size,
    numel,
)
from weight_transfer.protocol import (
    Claim,
    Decision,
    Digests,
    EngineJoin,
    Seen,
    Window,
    window_key,
)
from weight_transfer.serving import ServingGate, ServingStatus
from weight_transfer.verify import name_key, position_digest, region_position

log = logging.getLogger(__name__)


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

    Serving gate (`weight_transfer.serving`): writes land in place, so while an update is being
    written, and after one that failed once its writes began, the tensors may mix two updates.
    `serving` says whether the engine may serve now; `check_serving()` raises
    `NotServingError` and `wait_serving(timeout_s)` blocks while it may not. The gate closes
    when an update's window opens (`begin_update(k)`, or `wait_for_version(k)`), opens when
    update k is complete (`wait_for_version` returns, or `end_update(k)` for an engine with
    post-processing to do first), and stays closed (FAILED) after a failure until a later
    update completes: a failed update is never rolled back, the next complete one repairs it.
    With `ReceiverConfig.update_window` the trainers write only after such a call opened the
    window (`Window`), so the gate is closed whenever a byte of an update lands; without it the
    receiver is passive and the trainers do not wait for the engine's call.

    Not thread-safe; `version`, `wait_for_version` and the gate may be called from any thread.
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
        self._heard = 0  # newest update whose outcome this engine read (`wait_for_version`)
        # Whether this session's trainers wrote the version word (False after
        # `join_new_session` until the new session confirms an update here): a word kept from
        # an old session names no update of this one.
        self._word_of_session = True
        self._window: int | None = None  # the update window announced and not yet consumed
        self._applied = 0  # newest update whose patches this engine applied (delta mode)
        self._last_ack = 0
        self._last_digest = 0
        self.gate = ServingGate()
        """Whether the engine may serve now (see the class docstring)."""
        self._control = ControlPlane(control, server=False, member=f"engine {engine!r}")
        first = False
        try:
            first = self._claim_name()
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
        except BaseException:
            # Nothing of this engine stays behind: a name it claimed is free again (a retry
            # is not refused as "already registered"), and its connection is closed.
            if first:
                try:
                    self._control.delete(f"claim/engine/{engine}")
                except WeightTransferError as exc:
                    log.warning("engine %r: could not release its name: %s", engine, exc)
            self._control.close()
            raise
        log.info(
            "engine %s: registered %d tensors in %d regions over %s",
            engine,
            len(self._manifest.tensors),
            len(self._manifest.regions),
            self._transport.name,
        )

    def _claim_name(self) -> bool:
        """Claim this engine's name; True if no member had it.

        Raises:
            ControlPlaneAuthError: a stranger's value holds the name.
        """
        key = f"engine/{self.engine}"
        first, holder = self._control.claim(
            key, Claim(member=f"engine {self.engine!r}", nonce=os.urandom(16))
        )
        if not first and holder is None:
            raise ControlPlaneAuthError(
                f"engine {self.engine!r}: control message "
                f"{self._control.full_key('claim/' + key)!r} failed authentication: someone "
                "without the token claimed this name first"
            )
        return first

    def _publish_join(self) -> None:
        """Claim the next free join slot and publish the manifest and endpoint in it.

        A slot a stranger's value holds is skipped (the controller skips it too).
        """
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
                window=self.config.update_window,
            ),
        )

    def join_new_session(self, control: ControlPlaneConfig | None = None) -> None:
        """Join the control plane of a restarted controller, keeping memory and registrations.

        When the controller (and with it usually the trainer job) restarts, it hosts a new
        session with a new run id; a running engine calls this once (after `wait_for_version`
        raised `PeerLostError`, say) instead of restarting: it connects to `control` (default:
        the same address and token), claims its name there and publishes its unchanged
        manifest and endpoint. The new trainers plan and connect as on a first start. Its
        version word (and `version`, and the gate while it serves) keeps the last update it
        received, but that update belongs to the old session: no wait in the new session ends
        on it. `wait_for_version(k)` returns only an update the new session decided and wrote
        into this engine, whatever the old word reads (a new trainer job may count its steps
        from 1 again, or continue from the old word).

        Raises:
            TransportTimeoutError: the new control plane did not answer in time.
            ConfigurationError: the engine's name is already registered in that session (the
                controller did not restart: use `WeightSender.replan` with `rejoined`).
        """
        config = control or self._control.config
        # The old session's results are gone with it, and its step numbers mean nothing in the
        # new one: only the new session's verdicts complete a wait from now on.
        self._known_complete = 0
        self._heard = 0  # the new session's updates are heard of from its start
        self._word_of_session = False
        self._last_ack = self._last_digest = 0  # keys of the old store
        self._window = None
        if self._patch is not None:
            # A patch of the old session must never be applied in the new one (its steps may
            # be reused): an unwritten region header reads "no patch".
            self._patch[:HEADER_BYTES].zero_()
        self._control.close()
        self._control = ControlPlane(config, server=False, member=f"engine {self.engine!r}")
        if not self._claim_name():
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
        version_region = len(self._regions) - 1
        self._patch: torch.Tensor | None = None
        self._version_index = version_region
        self._patch_index: int | None = None
        if self.config.patch_region_bytes > 0:
            # Delta updates: the patch region comes right after the version word (the trainers
            # find it there, docs/delta.md), on the device of the weights.
            device = tensors[0].device if tensors else torch.device("cpu")
            use_kernels(self.config.patch_kernels)
            buf = torch.zeros(self.config.patch_region_bytes, dtype=torch.uint8, device=device)
            pregion = self._transport.register(buf, role=RegionRole.TARGET)
            self._patch = pregion.tensor
            self._regions.append(pregion)
            self._patch_index = len(self._regions) - 1
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
            version_region=version_region,
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

    def wait_for_version(self, step: int, timeout_s: float, *, serve: bool = True) -> int:
        """Block until update `step` (or a later one) is complete; returns the version seen.

        The wait blocks in the control plane on the controller's verdicts, so a failed update
        is reported here as soon as the controller decides it, with the controller's message
        naming the failed rank or peer. Each verdict is read once: `result/<v>` when this
        engine's version word already reads v, else `next/<u>`, the update decided after the
        last one u this engine heard of (so a step the trainers skip ends the wait with the
        next update). Two to four store requests per update; none while nothing happens.

        The serving gate closes at the call (the update's writes may land from now on) and
        opens when it returns (with `serve=False` it stays closed: the engine calls
        `end_update` after its own post-processing). If it raises, the gate stays closed:
        FAILED after a failure (the tensors may be mixed until a complete update lands),
        UPDATING after a timeout (the update may still be arriving).

        Raises:
            TransportTimeoutError: not reached within `timeout_s`.
            UpdateFailedError: the controller aborted update `step` (this engine's version
                did not advance, or the update was rolled back; the trainers may retry with a
                later step).
            PeerLostError: the controller is gone.
        """
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        try:
            self._open_window(step)
            v = self._wait_for_version(step, timeout_s)
        except TransportTimeoutError as exc:
            self.gate.still_updating(step, str(exc))
            raise
        except BaseException as exc:
            self.gate.fail(step, str(exc))
            raise
        self._window = None  # consumed: update v >= step completed here
        if serve:
            self.gate.commit(v)
        return v

    # -- the serving gate ----------------------------------------------------------------------

    @property
    def serving(self) -> ServingStatus:
        """The serving gate now: state, the version served, and why not, if not."""
        return self.gate.status

    def check_serving(self) -> int:
        """The version the engine may serve now.

        Raises:
            NotServingError: an update is being written, or one failed (the message says
                which and why); serve nothing.
        """
        return self.gate.check()

    def wait_serving(self, timeout_s: float) -> int:
        """Block until the engine may serve; returns the version.

        Raises:
            TransportTimeoutError: the gate stayed closed for `timeout_s`.
        """
        return self.gate.wait_serving(timeout_s)

    def begin_update(self, step: int) -> None:
        """Close the gate for update `step` before telling the trainer this engine is ready
        (`wait_for_version` closes it too; this is for an engine that pauses first). With
        `ReceiverConfig.update_window`, this opens the update window the trainers wait for.

        Raises:
            WeightTransferError: the window could not be announced (the control plane).
        """
        self._open_window(step)

    def _open_window(self, step: int) -> None:
        """Close the gate for `step`, then (`ReceiverConfig.update_window`) tell the trainers
        that the writes of updates from `step` on may land (`Window`). Once per window."""
        self.gate.begin(step)
        if self.config.update_window and self._window != step:
            self._control.put(window_key(self.engine), Window(engine=self.engine, step=step))
            self._window = step

    def end_update(self, step: int) -> None:
        """Open the gate on update `step`, complete (after `wait_for_version(step, serve=False)`
        and the engine's own post-processing).

        Raises:
            ValueError: update `step` was not confirmed complete.
        """
        if step > self._known_complete:
            raise ValueError(
                f"engine {self.engine!r}: update {step} is not complete (last complete: "
                f"{self._known_complete})"
            )
        self.gate.commit(step)

    def fail_update(self, step: int, reason: str) -> None:
        """The engine's own part of update `step` failed (its post-processing): FAILED until a
        later update completes."""
        self.gate.fail(step, reason)

    def _wait_for_version(self, step: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        if self._heard == 0 and (self.version < step or not self._word_of_session):
            # A member new to the session (joined late, or `join_new_session`) starts from
            # the newest decided update: the first links of the chain may be deleted already.
            # Later, the version word tells how far the trainers got (`result/<v>`).
            try:
                if self._control.exists("latest"):
                    self._hear(self._control.get("latest", Decision, 1.0), step)
            except TransportTimeoutError:
                pass
        while True:
            v = self.version
            if v >= step and v <= self._known_complete:
                return v
            remaining = deadline - time.monotonic()
            # `result/<v>` only for a word this session wrote (an old session's may name a
            # step this one never decides); otherwise follow the chain of verdicts.
            by_word = v > self._heard and self._word_of_session
            key = f"result/{v}" if by_word else f"next/{self._heard}"
            try:
                decision = self._control.get(key, Decision, max(0.001, remaining))
            except TransportTimeoutError:
                raise TransportTimeoutError(
                    f"engine {self.engine!r}: update {step} not complete after {timeout_s:.1f} s "
                    f"(version is {self.version})"
                ) from None
            self._hear(decision, step)

    def _hear(self, decision: Decision, step: int) -> None:
        """Take the controller's verdict on an update (`wait_for_version` waits for `step`).

        An update that succeeded is confirmed here once this engine's version word reads it
        (an update this engine is not part of, say after it left the plan, is only noted).
        """
        self._heard = max(self._heard, decision.step)
        v = self.version
        if not decision.ok:
            if decision.step != step:
                return  # another update failed: keep waiting for this one
            if v == decision.step:
                # Its version words were written here, then set back by the trainers (a later
                # update's word, read before this verdict, says nothing about this one's).
                raise UpdateFailedError(
                    f"engine {self.engine!r}: update {decision.step} failed while its version "
                    f"words were written and is rolled back (waiting for {step}): "
                    f"{decision.error}",
                    step=decision.step,
                )
            raise UpdateFailedError(
                f"engine {self.engine!r}: update {decision.step} failed and was not applied "
                f"(version is {v}): {decision.error}",
                step=decision.step,
            )
        if v < decision.step or decision.step <= self._known_complete:
            return
        self._known_complete = decision.step
        self._word_of_session = True
        try:
            # Lets a trainer job that is ending keep the control plane up until its engines
            # have seen the last update complete (`Controller.close`).
            self._control.put(f"seen/{self.engine}", Seen(engine=self.engine, step=decision.step))
        except WeightTransferError as exc:
            log.debug(
                "engine %r: could not acknowledge update %d: %s", self.engine, decision.step, exc
            )

    @property
    def applied_version(self) -> int:
        """The last update whose patch (if any) `apply_delta` applied; equals `version` once
        the engine ran its per-update work."""
        return self._applied

    def apply_delta(self, step: int, timeout_s: float, *, serve: bool = True) -> ApplyStats:
        """The one piece of per-update engine work in delta mode: wait until update `step` is
        complete (as `wait_for_version`), then apply the patches the trainer ranks wrote into
        this engine's patch region, in place, in the engine's own memory format (a scatter,
        `weight_transfer.kernels.delta`), and tell the trainers it did.

        Call it once per update, inside the update window (no forward pass may read the
        weights between `wait_for_version` and its return). A full update leaves no patch:
        then it only records the version. Without a patch region it is `wait_for_version`.
        Like `wait_for_version`, the wait may end with a later update than `step` (a step the
        trainers skipped); that update's patch is the one applied, acknowledged and served,
        and the returned `ApplyStats.step` names it.

        Raises:
            TransportTimeoutError / WeightTransferError: as `wait_for_version` (nothing applied).
            PatchError: the patch region holds no valid patch of `step` against the version
                this engine holds; nothing was written, the trainers are told (their next
                update is full for this engine) and this engine must not serve until then
                (its serving gate is FAILED).
            Exception: anything else that failed once the update was complete (a kernel, the
                verification digest, the acknowledgement): as for a `PatchError`, the gate is
                FAILED and the trainers are told (if the control plane still answers).

        The serving gate is handled as by `wait_for_version` (`serve=False`: the caller opens
        it with `end_update` after its own post-processing).
        """
        # The wait may end with a later update than `step` (a step the trainers skipped): the
        # patch to apply is the one of the update that ended it, `v`.
        v = self.wait_for_version(step, timeout_s, serve=False)
        if self._patch is None:
            self._applied = v
            if serve:
                self.gate.commit(v)
            return ApplyStats(step=v, num_slots=0, num_segments=0, num_entries=0, patch_bytes=0)
        t0 = time.perf_counter()
        try:
            stats = apply_patch_region(
                self._patch, self._delta_targets(), v, base_step=self._applied
            )
            if self._patch.is_cuda:
                torch.cuda.synchronize(self._patch.device)
            stats = dataclasses.replace(stats, apply_s=time.perf_counter() - t0)
            self._applied = v
            self._publish_position_digest(v)
            self._ack(v, ok=True, error="")
        except BaseException as exc:
            # Whatever failed (the patch, a kernel, the digest, the acknowledgement): serve
            # nothing, and tell the trainers, whose next update is then full for this engine
            # (without the acknowledgement they would wait out `apply_timeout_s` first).
            text = (
                str(exc) if isinstance(exc, WeightTransferError) else f"{type(exc).__name__}: {exc}"
            )
            reason = f"engine {self.engine!r}: update {v}: {text}"
            self.gate.fail(v, reason)
            if isinstance(exc, Exception):
                try:
                    self._ack(v, ok=False, error=reason)
                except WeightTransferError as ack_exc:
                    log.warning("%s; could not tell the trainers: %s", reason, ack_exc)
            if isinstance(exc, PatchError):
                raise PatchError(reason) from exc
            raise
        if serve:
            self.gate.commit(v)
        return stats

    def _delta_targets(self) -> list[torch.Tensor]:
        """The regions a patch may write, by region index: the weights' regions as they are;
        the version word and the patch region itself as empty views, so a segment aimed at
        either fails the bounds checks before anything is written."""
        out = [r.tensor for r in self._regions]
        for i in (self._version_index, self._patch_index):
            if i is not None:
                out[i] = out[i][:0]
        return out

    def _publish_position_digest(self, step: int) -> None:
        """Delta verification (`DeltaConfig.verify`): when the trainers asked for it, publish
        one position digest of every byte the recipes write, for them to check against the
        digests of what they sent (`weight_transfer.verify.position_digest`)."""
        key_name = verify_key_key(step)
        if not self._control.exists(key_name):
            return
        key = int(dict(self._control.get(key_name, Digests).digests)["key"]) ^ name_key(self.engine)
        total = 0
        for t in self._manifest.tensors:
            nbytes = numel(t.shape) * dtype_size(t.dtype)
            data = self._regions[t.region].tensor[t.offset_bytes : t.offset_bytes + nbytes]
            total += position_digest(data, region_position(t.region, t.offset_bytes), key)
        if self._last_digest:
            try:
                self._control.delete(engine_digest_key(self._last_digest, self.engine))
            except WeightTransferError as exc:  # only costs store memory
                log.debug("engine %r: could not delete an old digest: %s", self.engine, exc)
        self._last_digest = step
        self._control.put(
            engine_digest_key(step, self.engine),
            Digests(
                engine=self.engine,
                step=step,
                version=self.version,
                digests=(("sum", str(total & ((1 << 64) - 1))),),
            ),
        )

    def _ack(self, step: int, *, ok: bool, error: str) -> None:
        """Tell the trainers this engine applied (or could not apply) update `step`."""
        self._control.put(applied_key(step, self.engine), Decision(step=step, ok=ok, error=error))
        if self._last_ack:
            try:
                self._control.delete(applied_key(self._last_ack, self.engine))
            except WeightTransferError as exc:  # only costs store memory
                log.debug("engine %r: could not delete an old ack: %s", self.engine, exc)
        self._last_ack = step

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
