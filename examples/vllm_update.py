"""Train a model and push every step straight into a running vLLM engine (CPU, tiny random
Llama)."""

import secrets
import socket
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from weight_transfer.engines.vllm import (
    ControlPlaneConfig,
    LLMWeightSyncClient,
    OneSidedUpdater,
    TrainerInitInfo,
    TransferConfig,
)


def main() -> None:
    model_dir = tempfile.mkdtemp()
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    trainer = LlamaForCausalLM(config)  # float32; the engine runs float32 too
    trainer.save_pretrained(model_dir)

    # The plug-in registers itself with vLLM (entry point); select it by name.
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=256 << 20,  # the KV cache, explicit (see docs/vllm.md)
        weight_transfer_config={"backend": "weight_transfer"},
    )
    with socket.socket() as s:  # a free port for the control plane
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    transfer = TransferConfig(
        num_engines=1,  # vLLM worker processes (tensor parallel x data parallel)
        # One trainer process, which hands the token to vLLM itself: it may make its own.
        control=ControlPlaneConfig(port=port, token=secrets.token_hex(16)),
    )
    updater = OneSidedUpdater(TrainerInitInfo(config=transfer), trainer, LLMWeightSyncClient(llm))
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    for step in (1, 2, 3):
        tokens = torch.randint(0, config.vocab_size, (2, 16))
        trainer(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        stats = updater.update(step)  # one-sided writes into vLLM's memory
        print(
            f"update {step}: {stats.seconds * 1e3:.1f} ms, "
            f"vLLM weight version {llm.llm_engine.get_weight_version()}"
        )

    prompt = [1, 5, 9, 33]
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(max_tokens=8, temperature=0.0),
        use_tqdm=False,
    )
    seq = list(prompt)
    with torch.no_grad():  # the trainer's own greedy tokens
        for _ in range(8):
            seq.append(int(trainer(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert list(out[0].outputs[0].token_ids) == seq[len(prompt) :]
    print("verified: vLLM generates the trained model's greedy tokens")
    updater.close()


if __name__ == "__main__":
    main()
