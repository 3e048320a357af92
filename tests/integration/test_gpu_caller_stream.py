"""update() called right after the weights changed on the caller's CUDA stream, no synchronize.

A trainer process and an engine process on one GPU (`bench update --layout one-gpu --no-sync`):
before each update the trainer queues a ~0.2 s sleep kernel and then the weight change on its
current stream, and calls `update()` at once. Every update is verified against the reference
recipes applied to the changed weights (a keyed digest of every engine tensor), so an update that
read the weights before the kernel finished fails. Runs on every backend that imports here.
"""

from __future__ import annotations

import pytest

from tests.markers import backend_unavailable_reason, requires_cuda


def _backend(name: str):
    reason = backend_unavailable_reason(name)
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


@requires_cuda
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("backend", [_backend(b) for b in ("loopback", "ucx", "nixl")])
def test_update_orders_after_the_callers_stream(backend: str, fp8: bool, tmp_path) -> None:
    from weight_transfer.benchmarks.bench_update import BenchUpdateConfig, run

    cfg = BenchUpdateConfig(
        preset="tiny",
        backend=backend,
        fp8=fp8,
        layout="one-gpu",
        repeats=3,
        warmups=0,
        baseline=False,
        no_sync=True,
        timeout_s=240,
        json_path=str(tmp_path / "r.json"),
    )
    res = run(cfg)
    s = res["summary"]
    assert not res["errors"], res["errors"]
    assert s["verified_updates"] == 3 and s["verified"], s["mismatches"]
