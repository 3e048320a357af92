"""One engine rank: its tensors in vLLM's layout, registered once; then it waits for updates.

Start every process from one shell, so that all of them share one token:
    export WT_TOKEN=$(weight-transfer token)   # once; every member needs this same value
    python examples/engine.py 0 2 & python examples/engine.py 1 2 &
    torchrun --nproc-per-node 2 examples/trainer.py
A real engine passes its own parameters (an nn.Module or {name: tensor}) instead of
allocating them; with vLLM, use the plug-in instead (docs/vllm.md, "Use with vLLM").
"""

import os
import sys

from transformers import LlamaConfig

from weight_transfer import ControlPlaneConfig, TransferConfig, VllmLayout, WeightReceiver

tp_rank, tp_size = int(sys.argv[1]), int(sys.argv[2])
hf_config = LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
)

# The same config on every member (a TOML file maps onto it: weight_transfer.load_toml).
config = TransferConfig(
    transport="loopback",  # "tcp", "ucx", "nixl", "ibverbs" across hosts
    control=ControlPlaneConfig(host="127.0.0.1", port=29700, token=os.environ["WT_TOKEN"]),
)
layout = VllmLayout(hf_config, tp_rank, tp_size)  # fused qkv/gate_up, tp shards, and recipes
engine = f"replica0/tp{tp_rank}"
with WeightReceiver(layout.allocate(), layout, config, engine=engine) as receiver:
    for step in range(1, 4):
        receiver.wait_for_version(step, timeout_s=120)  # the trainers' writes land meanwhile
        print(f"engine tp{tp_rank}: weights of step {step} are in place", flush=True)
