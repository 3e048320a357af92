"""Host A of docs/two_hosts.md: the trainer (rank 0, hosting the control plane), three updates
into the engines on host B, each verified against the engines' published digests.

    WT_TOKEN=... python examples/two_hosts_trainer.py host-a.toml
"""

import os
import sys

import torch

from weight_transfer import (
    WeightSender,
    get_model_shape,
    hf_parameter_shapes,
    load_toml,
    materialize,
    vllm_recipes,
    vllm_tensor_specs,
)

# This host's file, plus the token from the environment (never in a file others may read).
cfg = load_toml(sys.argv[1], token=os.environ["WT_TOKEN"])
NUM_ENGINES = cfg.num_engines  # host B's tensor-parallel ranks (num_engines in the file)
own = cfg.transport_config()
print(
    f"host A: control plane on {cfg.control.host}:{cfg.control.port}; transport "
    f"{cfg.transport} binds {own.listen_host}, advertises {own.advertise_host}",
    flush=True,
)

shape = get_model_shape("tiny")
g = torch.Generator().manual_seed(0)
params = {n: torch.randn(s, generator=g) for n, s in hf_parameter_shapes(shape).items()}
sender = WeightSender(params, cfg)  # rank 0 of 1: hosts the control plane and plans
assert sender.controller is not None and NUM_ENGINES is not None
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
        bad = sender.controller.verify(step, expected, timeout_s=60)
        print(
            f"update {step}: {stats.nbytes} bytes in {stats.seconds * 1e3:.1f} ms, "
            + (f"MISMATCH {bad}" if bad else f"verified on {NUM_ENGINES} engines"),
            flush=True,
        )
        if bad:
            sys.exit(1)
finally:
    sender.close()  # and the control plane it hosts
