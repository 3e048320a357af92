"""Error paths leave nothing behind (issue 40, finding 17).

Each test drives one failure through the real object and checks what stayed: a thread, a
connection, a claimed name, a reply read as another request's, a gate opened after a failure.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
import torch

from weight_transfer import receiver as receiver_module
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import ControlPlaneConfig, TransferConfig
from weight_transfer.control import ControlPlane
from weight_transfer.engines.vllm.trainer import LLMWeightSyncClient
from weight_transfer.errors import NotServingError
from weight_transfer.planner.recipes import identity
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import _FailureWatch
from weight_transfer.serving import ServingState
from weight_transfer.store import _Host


def _control(timeout_s: float = 5.0) -> ControlPlaneConfig:
    return ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=timeout_s)


@pytest.mark.timeout(60)
def test_failure_watch_close_ends_its_thread_and_its_connection() -> None:
    # The watch blocks on abort/<k> of an update no verdict will end (its controller slow or
    # gone). Closing it used to give the thread 0.1 s, then leave thread and connection.
    host = ControlPlane(_control(), server=True, member="controller")
    try:
        watch = _FailureWatch(host, timeout_s=60.0)
        check = watch.watch(7)
        time.sleep(0.5)  # the thread blocks on abort/7
        t0 = time.monotonic()
        watch.close()
        assert time.monotonic() - t0 < 2.5
        assert not watch._thread.is_alive()
        assert watch._control._store is None, "the watch's connection is still open"
        assert check() is None  # the empty report that woke it is no failure
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_a_receiver_that_fails_after_claiming_its_name_releases_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp = _control()
    host = ControlPlane(cp, server=True, member="controller")
    made: list[ControlPlane] = []

    class Recorded(ControlPlane):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    def broken(*_: Any) -> Any:
        raise RuntimeError("injected: the transport could not start")

    monkeypatch.setattr(receiver_module, "ControlPlane", Recorded)
    real_create = receiver_module.create_transport
    monkeypatch.setattr(receiver_module, "create_transport", broken)
    g = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(8, 8, generator=g)}
    config = TransferConfig(num_engines=1, control=cp)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            WeightReceiver(tensors, [identity("w", "w", (8, 8))], config, engine="e0")
        assert made and made[0]._store is None, "the failed receiver's connection is open"
        monkeypatch.setattr(receiver_module, "create_transport", real_create)
        # The retry is not refused as "already registered".
        rx = WeightReceiver(tensors, [identity("w", "w", (8, 8))], config, engine="e0")
        rx.close()
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_the_store_host_never_takes_a_late_reply_for_the_next_one() -> None:
    import os
    import signal

    h = _Host(30.0)
    try:
        os.kill(h.pid, signal.SIGSTOP)  # the host is slow: this request times out
        try:
            with pytest.raises(RuntimeError, match="did not answer"):
                h.request({"op": "stop", "id": 999}, timeout_s=0.2)
        finally:
            os.kill(h.pid, signal.SIGCONT)
        time.sleep(0.2)  # its late {"ok": true} now waits in the channel
        with pytest.raises(RuntimeError, match="unknown request 'bogus'"):
            h.request({"op": "bogus"}, timeout_s=10.0)
        h.request({"op": "stop", "id": 998}, timeout_s=10.0)  # and the channel is in step
    finally:
        h.kill()


class _FakeLLM:
    """What `LLMWeightSyncClient` calls on a `vllm.LLM`; the workers' finish RPC raises."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.llm_engine = self

    def sleep(self, **_: Any) -> None:
        self.calls.append("sleep")

    def wake_up(self, **_: Any) -> None:
        self.calls.append("wake_up")

    def collective_rpc(self, method: str, **_: Any) -> None:
        self.calls.append(method)
        if method == "finish_weight_update":
            raise RuntimeError("injected: a worker's finish_weight_update failed")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def get_weight_version(self) -> str:
        return "0"


def test_a_failed_finish_weight_update_keeps_vllm_paused() -> None:
    llm = _FakeLLM()
    client = LLMWeightSyncClient(llm)
    client.start_weight_update()
    client.update_weights({"version": 1})
    with pytest.raises(RuntimeError, match="injected"):
        client.finish_weight_update("1")
    assert "wake_up" not in llm.calls, llm.calls
    assert client.serving.state is ServingState.FAILED and client.serving.step == 1
    with pytest.raises(NotServingError, match="finish_weight_update failed"):
        client.check_serving()
