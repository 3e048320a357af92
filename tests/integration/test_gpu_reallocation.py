"""FP8 on the GPU: quantize graphs are captured once, so a parameter that moves must fail the
update (naming it) instead of the graph reading memory the parameter no longer uses.

One process holds the trainer (CUDA parameters), the controller and the engine (CUDA tensors)
over loopback. Expectations are the CPU reference quantizer applied to the parameters, written
in the test. The addresses of every group's parameters are compared as one list per replay
(`pipeline.sources.PointerCheck`); this checks that in-place changes pass and a swap is caught.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from tests.markers import requires_cuda, requires_module
from weight_transfer.cli.run_demo import free_port
from weight_transfer.config import ControlPlaneConfig, SenderConfig, TransferConfig
from weight_transfer.controller import Controller
from weight_transfer.errors import UpdateFailedError
from weight_transfer.manifest import allocate_engine_tensors
from weight_transfer.planner.fp8 import quantize_fp8_blockwise
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.recipes import engine_tensor_specs, identity, scale_name, with_fp8
from weight_transfer.receiver import WeightReceiver
from weight_transfer.sender import WeightSender

SHAPES = {"w1": (256, 384), "w2": (130, 200), "w3": (384, 128)}


def _expect(engine: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    torch.cuda.synchronize()
    for n, t in src.items():
        q, s = quantize_fp8_blockwise(t.cpu(), (128, 128))
        assert torch.equal(engine[n].cpu().view(torch.uint8), q.view(torch.uint8)), n
        assert torch.equal(engine[scale_name(n)].cpu(), s), n


@requires_cuda
@requires_module("triton")
@pytest.mark.timeout(300)
def test_fp8_graph_sources_moved_fail_the_update_naming_the_parameter() -> None:
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(7)
    src = {n: torch.randn(s, device=dev, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}
    recipes = tuple(with_fp8(identity(n, n, s)) for n, s in SHAPES.items())
    tensors = allocate_engine_tensors(engine_tensor_specs(recipes), device=dev, seed=3)
    cp = ControlPlaneConfig(port=free_port(), token=secrets.token_hex(16), timeout_s=30)
    cfg = TransferConfig(
        num_engines=1,
        control=cp,
        sender=SenderConfig(update_timeout_s=60),
        planner=PlannerConfig(memory_budget_bytes=64 << 20),
    )
    ctrl = Controller(cfg.controller_config(1), cp)
    rx = WeightReceiver(tensors, recipes, cfg, engine="e0")
    sender = WeightSender(src, cfg, controller=ctrl, device=dev)
    try:
        assert sender._executor.graphs.groups, "the FP8 tasks were not captured as graphs"
        sender.update(1)
        _expect(tensors, src)
        for t in src.values():
            t.mul_(-1.5)  # in place: the addresses are unchanged
        sender.update(2)
        _expect(tensors, src)
        src["w2"].set_(torch.randn(SHAPES["w2"], device=dev).to(torch.bfloat16))
        with pytest.raises(UpdateFailedError, match="'w2' was reallocated"):
            sender.update(3)
        assert rx.version == 2
    finally:
        sender.close()
        rx.close()
        ctrl.close(linger_s=0)
