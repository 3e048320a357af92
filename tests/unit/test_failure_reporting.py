"""Any exception in any stage of any rank fails the update on every rank at once.

Three trainer ranks (FSDP2 shards) update four FP8 engines (tp=4) in one process through the
real runtime (`tests.unit._inprocess`). One rank is made to raise a plain exception (not one of
ours) in one stage: preparation (the quantizer), posting writes, or writing version words. Every
rank must raise within seconds (the timeouts are 30 s), naming the failing rank and the
exception; no engine's version word advances; the next update lands exactly.
"""

from __future__ import annotations

import pytest
import torch

from weight_transfer.backends.base import WeightTransferError
from weight_transfer.transfer.sender import WeightSender

from tests.unit._inprocess import Cluster
from tests.unit.test_layouts import TINY, check_engine, expected_vllm, hf_weights, make_engines, shards_for

FAIL_WITHIN_S = 5.0
"""Every rank raises within this (the control plane and update timeouts are 30 s)."""


class Boom(Exception):
    """The injected failure: deliberately not a WeightTransferError."""


def _inject(stage: str, armed: dict[str, bool]):
    def wrap(s: WeightSender) -> None:
        if s.rank != 2:
            return
        ex = s._executor
        if stage == "prepare":
            real_q = ex.quantize

            def quantize(*args):
                if armed["on"]:
                    raise Boom("injected in the quantizer")
                real_q(*args)

            ex.quantize = quantize
        elif stage == "write":
            tr = ex.transport
            real_post = tr.post_writes

            def post_writes(peer, ops):
                if armed["on"]:
                    raise Boom(f"injected posting to {peer}")
                return real_post(peer, ops)

            tr.post_writes = post_writes  # type: ignore[method-assign]
        else:
            real_wv = ex.write_versions

            def write_versions(step, timeout_s):
                if armed["on"]:
                    raise Boom("injected writing version words")
                real_wv(step, timeout_s)

            ex.write_versions = write_versions  # type: ignore[method-assign]

    return wrap


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["prepare", "write", "commit"])
def test_plain_exception_fails_every_rank_fast(monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    hf = hf_weights(TINY, 7)
    engines, befores = make_engines(TINY, 4, fp8=True, block=(128, 128), seed=70)
    armed = {"on": True}
    with Cluster(
        monkeypatch, hf, shards_for(hf, 3, "fsdp", 1), engines, world=3,
        timeout_s=30.0, update_timeout_s=30.0, wrap=_inject(stage, armed),
    ) as cluster:
        out = cluster.update(1)
        for r in range(3):
            exc = out.results[r]
            assert isinstance(exc, WeightTransferError), f"rank {r} returned {exc!r}"
            text = str(exc)
            assert "update 1" in text and "trainer rank 2" in text and "Boom: injected" in text, text
            assert out.seconds[r] < FAIL_WITHIN_S, f"rank {r} took {out.seconds[r]:.1f} s to fail"
        assert isinstance(out.results[2].__cause__, Boom)
        if stage != "commit":
            # No engine advanced and, before the commit step, none was written at all.
            for rx in cluster.receivers:
                assert rx.version == 0
        else:
            # Ranks 0 and 1 wrote their engines' words; rank 2's engines must not show 1.
            # (Replica-level atomicity is checked in test_version_atomicity.)
            pass
        armed["on"] = False
        with torch.no_grad():
            for t in hf.values():
                t.mul_(-1)
        cluster.refresh_locals()
        ok = cluster.update(2)
        bad = {r: v for r, v in ok.results.items() if isinstance(v, BaseException)}
        assert not bad, f"the update after the failure failed: {bad}"
        for r, e in enumerate(engines):
            assert cluster.receivers[r].version == 2
            check_engine(e.name, e.tensors, befores[r], expected_vllm(TINY, hf, r, 4), fp8=True, block=(128, 128))
