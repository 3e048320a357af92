"""One engine rank: allocate its vLLM-layout tensors, register them, wait for three updates.

Run one per tensor-parallel rank (here tp=2), beside the trainer (examples/trainer.py):
    WT_TOKEN=$(weight-transfer token) python examples/engine.py 0 2 &
    WT_TOKEN=... python examples/engine.py 1 2
A real engine passes its own parameters (an nn.Module or {name: tensor}) instead of
allocating them; with vLLM, use the plug-in instead (README, "Use with vLLM").
"""

import os
import sys

from transformers import LlamaConfig

from weight_transfer import (
    ControlPlaneConfig,
    TransportConfig,
    WeightReceiver,
    allocate_engine_tensors,
    from_hf_config,
    vllm_recipes,
    vllm_tensor_specs,
)

tp_rank, tp_size = int(sys.argv[1]), int(sys.argv[2])
hf_config = LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
)
shape = from_hf_config(hf_config)

# Trainer rank 0 hosts the control plane (a TCPStore) at this address; every member connects.
control = ControlPlaneConfig(host="127.0.0.1", port=29700, token=os.environ["WT_TOKEN"])

# The engine's tensors, in vLLM's per-rank layout (fused qkv_proj / gate_up_proj, tp shards).
tensors = allocate_engine_tensors(vllm_tensor_specs(shape, tp_rank, tp_size))
receiver = WeightReceiver(
    tensors,
    vllm_recipes(shape, tp_rank, tp_size),  # which trainer bytes make each engine tensor
    engine=f"replica0/tp{tp_rank}",
    transport=TransportConfig(name="loopback"),  # "tcp", "ucx", "nixl", "ibverbs" across hosts
    control=control,
)
try:
    for step in range(1, 4):
        receiver.wait_for_version(step, timeout_s=120)  # the engine runs no per-update code
        print(f"engine tp{tp_rank}: weights of step {step} are in place", flush=True)
finally:
    receiver.close()
