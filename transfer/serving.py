"""The serving gate: whether an engine's tensors hold one complete update, so that it may serve.

Writes land in place, so between the first write of update k and its commit, and after an
update that failed once its writes began, an engine's tensors may hold part of k and part of
k-1: a model that never existed. The gate is the engine's one place to ask whether it may run
a forward pass now. Three states:

- SERVING: the tensors hold update `version` completely (0: the weights the engine started
  with). Forward passes may run.
- UPDATING: update `step` may be writing now (its window opened: `WeightReceiver.begin_update`
  or `wait_for_version`, or a wait for it timed out with nothing decided). Serve nothing.
- FAILED: update `step` failed after its writes may have begun (`reason` says why), so the
  tensors may be mixed. Serve nothing until a complete update lands (the next update that
  commits opens the gate again); the version word still reads the last complete update.

Fail closed means: never SERVING unless the last window closed with a complete update. The gate
does not stop a forward pass by itself; the engine checks it (`check`) or waits on it
(`wait_serving`) before it serves, or keeps its scheduler paused while it is closed (the vLLM
plug-in does the latter). Thread-safe: the engine's serving threads read it while the thread
that receives updates moves it.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time

from weight_transfer.errors import NotServingError, TransportTimeoutError

__all__ = ["ServingGate", "ServingState", "ServingStatus"]


class ServingState(str, enum.Enum):
    """Whether an engine may serve (module docstring)."""

    SERVING = "serving"
    UPDATING = "updating"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, slots=True)
class ServingStatus:
    """A snapshot of the gate."""

    state: ServingState
    version: int
    """The last update the tensors held completely (0: the weights the engine started with)."""
    step: int
    """The update being written (UPDATING) or that failed (FAILED); `version` when SERVING."""
    reason: str = ""
    """Why the engine may not serve ("" when SERVING)."""

    @property
    def serving(self) -> bool:
        """True in SERVING only."""
        return self.state is ServingState.SERVING

    def describe(self) -> str:
        """One line for messages and logs."""
        if self.serving:
            return f"serving update {self.version}"
        what = "being written" if self.state is ServingState.UPDATING else "failed"
        return (
            f"not serving: update {self.step} {what}, the tensors may mix it with update "
            f"{self.version}" + (f" ({self.reason})" if self.reason else "")
        )


class ServingGate:
    """The gate of one engine rank (module docstring). Thread-safe.

    `begin`, `commit` and `fail` move it; they are called by whatever closes an update window
    (`WeightReceiver`, the vLLM plug-in, its client), not by the serving code.
    """

    def __init__(self, version: int = 0) -> None:
        self._cond = threading.Condition()
        self._status = ServingStatus(ServingState.SERVING, version, version)

    @property
    def status(self) -> ServingStatus:
        """The gate now."""
        with self._cond:
            return self._status

    @property
    def serving(self) -> bool:
        """Whether a forward pass may run now."""
        return self.status.serving

    def check(self) -> int:
        """The version being served; raises if the engine must not serve now.

        Raises:
            NotServingError: the gate is UPDATING or FAILED (the message says which update
                and why).
        """
        status = self.status
        if not status.serving:
            raise NotServingError(status.describe())
        return status.version

    def wait_serving(self, timeout_s: float) -> int:
        """Block until the gate is SERVING; returns the version served.

        Raises:
            TransportTimeoutError: still closed after `timeout_s` (the message says why).
        """
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._status.serving:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeoutError(
                        f"still {self._status.describe()} after {timeout_s:.1f} s"
                    )
                self._cond.wait(remaining)
            return self._status.version

    def begin(self, step: int) -> None:
        """Update `step`'s writes may land from now on: close the gate (UPDATING), unless an
        earlier update already failed it (it stays FAILED: the tensors are mixed already)."""
        with self._cond:
            s = self._status
            if s.state is ServingState.FAILED:
                self._status = dataclasses.replace(s, reason=f"{s.reason}; update {step} began")
                return
            self._status = ServingStatus(
                ServingState.UPDATING, s.version, step, f"update {step} is being written"
            )

    def commit(self, version: int) -> None:
        """The tensors hold update `version` completely: open the gate."""
        with self._cond:
            self._status = ServingStatus(ServingState.SERVING, version, version)
            self._cond.notify_all()

    def still_updating(self, step: int, reason: str) -> None:
        """Update `step`'s window is open and nothing was decided (a wait for it timed out):
        the gate stays closed, as UPDATING (FAILED stays FAILED)."""
        with self._cond:
            s = self._status
            if s.state is not ServingState.FAILED:
                self._status = ServingStatus(ServingState.UPDATING, s.version, step, reason)

    def fail(self, step: int, reason: str) -> None:
        """Update `step` failed after its writes may have begun: FAILED until a commit."""
        with self._cond:
            self._status = ServingStatus(ServingState.FAILED, self._status.version, step, reason)

    def reopen(self) -> None:
        """The window closed without a byte written (the update never started writing): back
        to SERVING the version it served, unless an earlier failure left it FAILED."""
        with self._cond:
            s = self._status
            if s.state is ServingState.UPDATING:
                self._status = ServingStatus(ServingState.SERVING, s.version, s.version)
                self._cond.notify_all()
