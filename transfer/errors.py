"""One hierarchy of errors for the whole project (a neutral module: planner, transfer and
backends all import it, and it imports none of them)."""

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


class UpdateAbortedError(WeightTransferError):
    """This rank stopped an update because another rank failed (named in the message)."""


class UpdateInProgressError(WeightTransferError):
    """A new update was refused: a previous update's thread on this rank (named in the message,
    with the collective it is blocked in) outlived its deadline and still runs."""


class NotServingError(WeightTransferError):
    """The engine's weights are not a complete update right now (an update is being written,
    or one failed after its writes began): it must serve nothing until a complete one lands."""
