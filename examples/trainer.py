"""The trainer: an FSDP2 Llama on gloo; after each optimizer step, one update into the engines.

Run with torchrun, with the engines' WT_TOKEN (examples/engine.py says how):
    torchrun --nproc-per-node 2 examples/trainer.py
Every rank sends its own shards; rank 0 also hosts the control plane and plans the transfer.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from weight_transfer import ControlPlaneConfig, PlannerConfig, TransferConfig, WeightSender

dist.init_process_group("gloo")
hf_config = LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
)
torch.manual_seed(0)
model = LlamaForCausalLM(hf_config).to(torch.bfloat16)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

config = TransferConfig(
    transport="loopback",
    num_engines=2,  # engine ranks of all replicas together
    control=ControlPlaneConfig(host="127.0.0.1", port=29700, token=os.environ["WT_TOKEN"]),
    planner=PlannerConfig(memory_budget_bytes=64 << 20),  # staging + scratch, per rank
)
with WeightSender(model, config) as sender:  # rank and world from the process group
    for step in range(1, 4):
        tokens = torch.randint(0, hf_config.vocab_size, (2, 16))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = sender.update(step)  # collective; returns once every engine holds step's weights
        if dist.get_rank() == 0:
            print(f"update {step}: {stats.seconds * 1e3:.1f} ms", flush=True)
    if dist.get_rank() == 0:
        sender.write_trace("update_trace.json")  # Chrome/Perfetto trace of the stages
dist.destroy_process_group()
