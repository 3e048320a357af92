"""Host A of README "Two hosts": the trainer (rank 0, hosting the control plane), three updates
into the engines on host B, each verified against the engines' published digests.

    WT_TOKEN=... python examples/two_hosts_trainer.py host-a.toml
"""

import os
import sys

import torch

from weight_transfer import Controller, ControllerConfig, WeightSender, get_model_shape
from weight_transfer.config import config_from_mapping, merge, read_toml
from weight_transfer.planner.presets.models import hf_parameter_shapes
from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
from weight_transfer.planner.reference import materialize

NUM_ENGINES = 2  # host B's tensor-parallel ranks

# This host's file, plus the token from the environment (never in a file others may read).
cfg = config_from_mapping(
    merge(read_toml(sys.argv[1]), {"control": {"token": os.environ["WT_TOKEN"]}})
)
own = cfg.transport_config()
print(
    f"host A: control plane on {cfg.control.host}:{cfg.control.port}; transport "
    f"{cfg.transport} binds {own.listen_host}, advertises {own.advertise_host}",
    flush=True,
)

shape = get_model_shape("tiny")
g = torch.Generator().manual_seed(0)
params = {n: torch.randn(s, generator=g) for n, s in hf_parameter_shapes(shape).items()}
controller = Controller(
    ControllerConfig(num_trainer_ranks=1, num_engines=NUM_ENGINES, planner=cfg.planner),
    cfg.control,
)
sender = WeightSender(
    params,
    rank=0,
    world_size=1,
    transport=own,
    control=cfg.control,
    controller=controller,
    config=cfg.sender,
)
try:
    for step in range(1, 4):
        for t in params.values():  # stands in for an optimizer step
            t.add_(torch.randn(t.shape, generator=g) * 0.01)
        stats = sender.update(step)
        expected = {
            f"hostb/tp{r}": materialize(
                vllm_recipes(shape, r, NUM_ENGINES),
                vllm_tensor_specs(shape, r, NUM_ENGINES),
                params,
            )
            for r in range(NUM_ENGINES)
        }
        bad = controller.verify(step, expected, timeout_s=60)
        print(
            f"update {step}: {stats.nbytes} bytes in {stats.seconds * 1e3:.1f} ms, "
            + (f"MISMATCH {bad}" if bad else f"verified on {NUM_ENGINES} engines"),
            flush=True,
        )
        if bad:
            sys.exit(1)
finally:
    sender.close()
    controller.close()
