"""Host B of docs/two_hosts.md: one engine rank (tp rank, tp size from argv) receiving three
updates from the trainer on host A, publishing a digest of its tensors after each.

    WT_TOKEN=... python examples/two_hosts_engine.py host-b.toml 0 2
"""

import os
import sys

from weight_transfer import (
    WeightReceiver,
    allocate_engine_tensors,
    get_model_shape,
    load_toml,
    vllm_recipes,
    vllm_tensor_specs,
)

tp_rank, tp_size = int(sys.argv[2]), int(sys.argv[3])
cfg = load_toml(sys.argv[1], token=os.environ["WT_TOKEN"])
own = cfg.transport_config()
print(f"engine tp{tp_rank}: binds {own.listen_host}, advertises {own.advertise_host}", flush=True)

shape = get_model_shape("tiny")
receiver = WeightReceiver(
    allocate_engine_tensors(vllm_tensor_specs(shape, tp_rank, tp_size)),
    vllm_recipes(shape, tp_rank, tp_size),
    cfg,
    engine=f"hostb/tp{tp_rank}",
)
try:
    for step in range(1, 4):
        receiver.wait_for_version(step, timeout_s=120)
        receiver.publish_digests(step)  # for the trainer's check
        print(f"engine tp{tp_rank}: weights of step {step} are in place", flush=True)
finally:
    receiver.close()
