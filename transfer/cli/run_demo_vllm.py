"""`weight-transfer demo-vllm`: the demo's update, into a real running vLLM engine.

Needs vLLM (on CPU: docs/vllm.md, "Use with vLLM"). The demo saves a tiny random
Llama, starts a `vllm.LLM` on it with the `weight_transfer` plug-in, and starts `train_ranks`
trainer processes (FSDP2 over gloo, AdamW between updates). Trainer rank 0 drives vLLM's four
phases; this process runs them on its `LLM` (as vLLM's HTTP routes would). Every update is
verified three ways: every tensor vLLM received equals the reference materialization of the
trainer's full weights bit for bit (engines publish sha256 digests), vLLM's weight version
reads the step, and vLLM's greedy tokens on a probe prompt equal the trainer's own.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PROBE = [1, 5, 9, 33, 71, 2]
PROBE_TOKENS = 8
KV_CACHE_BYTES = 256 << 20
"""The demo engine's KV cache. Explicit: vLLM's CPU backend would reserve
`gpu_memory_utilization` of the first NUMA node's memory, too little on a VM with a small node 0
and wasteful on a large one."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VllmDemoConfig:
    """What `demo-vllm` runs."""

    backend: str = "loopback"
    """Transport backend name."""
    train_ranks: int = 2
    """Trainer processes (FSDP2 over gloo)."""
    engine_ranks: int = 1
    """vLLM tensor-parallel size."""
    steps: int = 3
    """Verified updates, with an optimizer step before each."""
    dtype: str = "float32"
    """Trainer and engine dtype (float32 makes vLLM's and the trainer's greedy tokens exact)."""
    timeout_s: float = 600.0
    """Longest the whole demo may take."""

    def __post_init__(self) -> None:
        if self.train_ranks < 1 or self.engine_ranks < 1 or self.steps < 1:
            raise ValueError("train_ranks, engine_ranks and steps must be >= 1")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


@dataclasses.dataclass(frozen=True, slots=True)
class VllmUpdateReport:
    """One verified update into vLLM."""

    step: int
    seconds: float
    """Trainer rank 0's transfer time (writes and commit)."""
    mismatches: tuple[str, ...]
    """Engine tensors whose digest differs from the reference."""
    weight_version: str
    tokens_equal: bool
    """vLLM's greedy probe tokens equal the trainer's."""

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return not self.mismatches and self.tokens_equal and self.weight_version == str(self.step)


def _llama_config(dtype: str) -> Any:
    from transformers import LlamaConfig

    from weight_transfer.planner.presets.models import get_model_shape

    s = get_model_shape("tiny")
    return LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


class _ProxyClient:
    """Trainer rank 0's client: each vLLM phase is run by the demo's main process on its LLM."""

    def __init__(self, channel: Any, timeout_s: float) -> None:
        self.channel, self.timeout_s = channel, timeout_s

    def _call(self, name: str, *args: Any) -> None:
        self.channel.put(("rpc", name, args))
        kind, value = self.channel.get(self.timeout_s)
        if kind == "err":
            raise RuntimeError(value)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def abort_weight_update(self) -> None:
        self._call("abort_weight_update")


def trainer_main(
    rank: int,
    cfg: VllmDemoConfig,
    model_dir: str,
    ports: tuple[int, int],
    token: str,
    channel: Any,
) -> None:
    """One trainer process: FSDP2 Llama, AdamW step, update into vLLM, verify; K times.

    Rank 0 asks the demo's process, over its launcher `channel`, to run vLLM's phases and to
    check each update."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from weight_transfer.config import SenderConfig
    from weight_transfer.engines.vllm import (
        ControlPlaneConfig,
        OneSidedUpdater,
        TrainerInitInfo,
        TransferConfig,
        VllmConfig,
    )
    from weight_transfer.planner.presets.models import get_model_shape
    from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
    from weight_transfer.planner.reference import materialize

    torch.set_num_threads(1)
    cp_port, dist_port = ports
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=cfg.train_ranks,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        mesh = init_device_mesh("cpu", (cfg.train_ranks,))
        dtype = getattr(torch, cfg.dtype)
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        info = TrainerInitInfo(  # rank and world from the process group
            config=TransferConfig(
                transport=cfg.backend,
                num_engines=cfg.engine_ranks,
                control=ControlPlaneConfig(port=cp_port, token=token, timeout_s=cfg.timeout_s / 2),
                sender=SenderConfig(update_timeout_s=cfg.timeout_s / 2),
                vllm=VllmConfig(publish_digests=True),
            )
        )
        updater = OneSidedUpdater(
            info, model, _ProxyClient(channel, cfg.timeout_s) if rank == 0 else None
        )
        shape = get_model_shape("tiny")
        ref = (
            LlamaForCausalLM(_llama_config(cfg.dtype)).to(dtype).eval()  # type: ignore[no-untyped-call]
            if rank == 0
            else None
        )
        g = torch.Generator().manual_seed(1)
        for step in range(1, cfg.steps + 1):
            tokens = torch.randint(0, shape.vocab_size, (2, 32), generator=g)
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
            stats = updater.update(step)
            with torch.no_grad():
                # FSDP2 parameters are DTensors.
                full = {
                    n: p.full_tensor().detach()  # type: ignore[attr-defined]
                    for n, p in model.named_parameters()
                }
            if rank == 0:
                assert updater.controller is not None and ref is not None
                expected = {}
                for e in range(cfg.engine_ranks):
                    expected[f"vllm/rank{e}"] = materialize(
                        vllm_recipes(shape, e, cfg.engine_ranks),
                        vllm_tensor_specs(shape, e, cfg.engine_ranks, param_dtype=cfg.dtype),
                        full,
                    )
                bad = updater.controller.verify(step, expected, cfg.timeout_s)
                ref.load_state_dict(full)
                seq = list(PROBE)
                with torch.no_grad():
                    for _ in range(PROBE_TOKENS):
                        seq.append(int(ref(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
                channel.put(("check", step, stats.seconds, tuple(bad), seq[len(PROBE) :]))
                kind, value = channel.get(cfg.timeout_s)
                if kind != "ok":
                    raise RuntimeError(value)
            dist.barrier()
        updater.close()
    finally:
        dist.destroy_process_group()


def run_vllm_demo(
    cfg: VllmDemoConfig, *, on_update: Callable[[VllmUpdateReport], None] | None = None
) -> list[VllmUpdateReport]:
    """Start vLLM and the trainers, serve rank 0's phases, verify every update.

    Raises:
        WeightTransferError: a trainer failed or the demo ran out of time (the message says
            which).
        ImportError: vLLM is not installed.
    """
    from transformers import LlamaForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from weight_transfer.cli.launch import Child, Launch
    from weight_transfer.cli.run_demo import free_port
    from weight_transfer.engines.vllm import BACKEND, LLMWeightSyncClient
    from weight_transfer.errors import WeightTransferError

    reports: list[VllmUpdateReport] = []
    with tempfile.TemporaryDirectory(prefix="wt-demo-vllm-") as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        LlamaForCausalLM(_llama_config(cfg.dtype)).to(  # type: ignore[no-untyped-call]
            getattr(torch, cfg.dtype)
        ).save_pretrained(model_dir)
        t0 = time.monotonic()
        llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=cfg.dtype,  # type: ignore[arg-type]
            enforce_eager=True,
            max_model_len=128,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            tensor_parallel_size=cfg.engine_ranks,
            seed=0,
            weight_transfer_config={"backend": BACKEND},
        )
        log.info("vLLM started in %.1f s", time.monotonic() - t0)
        client = LLMWeightSyncClient(llm)
        ports, token = (free_port(), free_port()), secrets.token_hex(16)
        launch = Launch(
            [
                Child(f"trainer{r}", trainer_main, (r, cfg, str(model_dir), ports, token))
                for r in range(cfg.train_ranks)
            ]
        )
        deadline = time.monotonic() + cfg.timeout_s
        sp = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0)
        try:
            launch.start()
            while len(reports) < cfg.steps:
                if time.monotonic() > deadline:
                    raise WeightTransferError(f"demo-vllm: not done within {cfg.timeout_s:.0f} s")
                got = launch.get(timeout_s=0.5)
                if got is None:
                    failure = launch.failure()
                    if failure is not None:
                        raise WeightTransferError(f"demo-vllm: {failure}") from None
                    continue
                who, msg = got
                if msg[0] == "rpc":
                    try:
                        getattr(client, msg[1])(*msg[2])
                        launch.send(who, ("ok", None))
                    except Exception as exc:  # handed to trainer rank 0, which raises it
                        launch.send(who, ("err", f"{type(exc).__name__}: {exc}"))
                    continue
                _, step, seconds, bad, want = msg
                out = llm.generate([TokensPrompt(prompt_token_ids=PROBE)], sp, use_tqdm=False)
                rep = VllmUpdateReport(
                    step=step,
                    seconds=seconds,
                    mismatches=tuple(bad),
                    weight_version=str(llm.llm_engine.get_weight_version()),
                    tokens_equal=list(out[0].outputs[0].token_ids) == list(want),
                )
                reports.append(rep)
                if on_update is not None:
                    on_update(rep)
                launch.send(who, ("ok", None))
        finally:
            codes = launch.close(grace_s=60)
            del llm
        if any(c != 0 for c in codes.values()):
            raise WeightTransferError(f"demo-vllm: trainer exit codes {codes}")
    return reports
