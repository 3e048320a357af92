"""One hierarchy of errors for the whole project (a neutral module: planner, transfer and
backends all import it, and it imports none of them).

What an integrator catches, by what it can do about it:

* `UpdateFailedError`: an update failed and no engine advanced; retryable (call `update` again
  with a larger step; if an engine is gone, `replan` first). Raised on every trainer rank and in
  every engine waiting for that update.
* `ConfigurationError`: a setting or argument is wrong; fix it (nothing was started).
* `PeerLostError`: a peer (named) disconnected: restart or replan around it.
* `TransportTimeoutError`: a wait ran out (what and whom it waited for are named).
* `ControlPlaneAuthError`: a member holds another token, or someone tampers with the store.

All derive from `WeightTransferError`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ConfigurationError",
    "ControlPlaneAuthError",
    "PeerLostError",
    "PlanMismatchError",
    "TransportError",
    "TransportTimeoutError",
    "TransportUnavailableError",
    "NotServingError",
    "UpdateAbortedError",
    "UpdateFailedError",
    "UpdateInProgressError",
    "WeightTransferError",
]


class WeightTransferError(RuntimeError):
    """Base class of every error this project raises on purpose."""


class ConfigurationError(WeightTransferError, ValueError):
    """A configuration value or an argument is invalid."""


class PlanMismatchError(WeightTransferError):
    """Source and destination manifests cannot be reconciled; `problems` lists every cause."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = "\n  ".join(self.problems[:50])
        more = f"\n  ... and {len(self.problems) - 50} more" if len(self.problems) > 50 else ""
        super().__init__(f"{len(self.problems)} plan problem(s):\n  {shown}{more}")


class TransportError(WeightTransferError):
    """A transport operation failed."""


class TransportUnavailableError(TransportError):
    """A backend cannot run here (package missing, no device); the message says how to fix it."""


class PeerLostError(TransportError):
    """A peer (named in the message) disconnected or stopped answering."""


class TransportTimeoutError(WeightTransferError, TimeoutError):
    """A wait ran past its timeout; the message says what was awaited and from whom."""


class ControlPlaneAuthError(WeightTransferError):
    """A control-plane message failed authentication (wrong token or tampered data)."""


class UpdateFailedError(WeightTransferError):
    """An update failed and no engine advanced to it; the message names the failing rank or peer.

    Retryable: the sender (and every engine) stays usable, and the next `update` with a larger
    step uses the same plan (after `WeightSender.replan` if an engine is gone). Raised by
    `WeightSender.update` on every trainer rank and by `WeightReceiver.wait_for_version` in
    every engine that waits for the update; `__cause__` is this process's own failure, if any.
    """

    retryable = True
    """Always True: the transfer can be tried again with a later step."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step
        """The update that failed."""


class UpdateAbortedError(WeightTransferError):
    """This rank stopped an update because another rank failed (named in the message).

    Internal to an update: `WeightSender.update` turns it into the `UpdateFailedError` every
    rank raises."""


class UpdateInProgressError(UpdateFailedError):
    """A new update was refused: a previous update's thread on this rank (named in the message,
    with the collective it is blocked in) outlived its deadline and still runs.

    An `UpdateFailedError` (no engine advanced): retry once that thread ended."""


class NotServingError(WeightTransferError):
    """The engine's weights are not a complete update right now (an update is being written,
    or one failed after its writes began): it must serve nothing until a complete one lands."""
