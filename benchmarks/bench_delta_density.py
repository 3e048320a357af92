"""How many engine bytes change per RL step: densities for delta updates, from real optimizer steps.

No package installable here ships a trained language-model checkpoint (the wheels checked are
listed in the results file), and hub downloads do not work on these machines, so the harness
makes the most realistic substitute it can on a CPU: it pretrains a small Qwen3-MoE model
(transformers' `Qwen3MoeForCausalLM`: GQA attention with q/k norms, one dense SwiGLU layer and
MoE layers with stacked experts, untied embeddings, a BPE vocabulary) on real text found on this
machine (the Python standard library's sources) until its loss has dropped well below the
unigram entropy, then runs RL steps from that checkpoint the way RL frameworks do: a fresh AdamW
(fp32 master weights, betas (0.9, 0.999), weight decay 0.01, gradient clipping 1.0) at an RL
learning rate, on-policy GRPO-style policy-gradient steps (sampled completions, group-normalised
rewards).

After every RL step it builds what the engines hold, in the engine's layout:

* BF16 targets: every parameter cast to bfloat16 (the trainer's fp32 master, as FSDP2's mixed
  precision hands it to the engine);
* FP8 targets: the vLLM layout (fused `qkv_proj`, fused `gate_up_proj`, stacked `w13`/`w2`),
  quantized in 128x128 blocks with `planner.fp8` (scales float32, amax / 448), from the fp32
  master and, separately, from its bfloat16 cast (a trainer that keeps bf16 parameters);
  embeddings, norms, router and lm_head stay BF16 in FP8 engines (vLLM's convention).

and compares them with the previous step's bytes: per tensor type the fraction of elements
(bf16 values / fp8 bytes) that changed, the fraction of 128x128 blocks with any change, the
fraction of FP8 scales that changed, and what each candidate encoding would put on the wire
(`weight_transfer.kernels.delta.encoded_nbytes`).

    python benchmarks/bench_delta_density.py --json out.json --md out.md

Timing figures it prints (seconds per step) come from a shared 2-core machine and are not
benchmark results; the densities do not depend on timing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import platform
import sys
import time
import typing
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from weight_transfer.kernels.delta import ENCODINGS, encoded_nbytes
from weight_transfer.planner.fp8 import quantize_fp8_blockwise


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DensityConfig:
    """What to run (argparse fills it)."""

    corpus_dir: str = "/usr/lib/python3.11"
    """Real text to pretrain on (every *.py under it, sorted)."""
    corpus_bytes: int = 24 << 20
    """Bytes of the corpus to use."""
    vocab_size: int = 8192
    """BPE vocabulary trained on the corpus."""
    hidden_size: int = 256
    num_layers: int = 4
    """Layer 0 is a dense SwiGLU layer, the others MoE."""
    num_experts: int = 16
    pretrain_steps: int = 400
    pretrain_lr: float = 3e-3
    pretrain_batch: int = 16
    seq_len: int = 128
    rl_lrs: tuple[float, ...] = (1e-6, 1e-5)
    rl_steps: int = 24
    rl_prompts: int = 8
    rl_group: int = 4
    rl_prompt_len: int = 32
    rl_completion_len: int = 32
    seed: int = 0
    threads: int = 2
    cost_densities: tuple[float, ...] = ()
    """Only measure encode/apply costs of the encodings at these densities (no training)."""
    cost_numel: int = 1 << 24
    """Elements of the BF16 tensor the costs are measured on."""
    cost_repeats: int = 5
    checkpoint: str | None = None
    """Save (or reuse, if it exists) the pretrained model here."""
    json_path: str | None = None
    md_path: str | None = None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- corpus, tokenizer, model ---------------------------------------------------------------


def _corpus(cfg: DensityConfig) -> str:
    parts, total = [], 0
    for p in sorted(Path(cfg.corpus_dir).rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts or "tests" in p.parts:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= cfg.corpus_bytes:
            break
    return "\n".join(parts)


def _tokenize(cfg: DensityConfig, text: str) -> tuple[torch.Tensor, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, show_progress=False)
    tok.train_from_iterator([text[i : i + 1 << 20] for i in range(0, len(text), 1 << 20)], trainer)
    ids = tok.encode(text).ids
    return torch.tensor(ids, dtype=torch.int64), tok


def _model(cfg: DensityConfig, vocab: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=cfg.hidden_size // 8,
        intermediate_size=4 * cfg.hidden_size,
        moe_intermediate_size=cfg.hidden_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    torch.manual_seed(cfg.seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**settings))


def _batches(ids: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> Iterator[torch.Tensor]:
    while True:
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])


def _pretrain(cfg: DensityConfig, model: torch.nn.Module, ids: torch.Tensor) -> dict[str, float]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    warm = 20

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.pretrain_lr * (step + 1) / warm
        frac = (step - warm) / max(1, cfg.pretrain_steps - warm)
        return cfg.pretrain_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    losses = []
    t0 = time.perf_counter()
    it = _batches(ids, cfg.pretrain_batch, cfg.seq_len, g)
    model.train()
    for step in range(cfg.pretrain_steps):
        x = next(it)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss))
        if step % 25 == 0 or step == cfg.pretrain_steps - 1:
            _log(f"pretrain step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)")
    counts = torch.bincount(ids, minlength=cfg.vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return {
        "first_loss": losses[0],
        "final_loss_mean_last20": sum(losses[-20:]) / len(losses[-20:]),
        "unigram_entropy_nats": float(-(p * p.log()).sum()),
        "seconds": time.perf_counter() - t0,
    }


# -- what the engine holds ------------------------------------------------------------------


def _kind(name: str) -> str:
    """Tensor type of an HF parameter name."""
    for key, kind in (
        ("embed_tokens", "embed"),
        ("lm_head", "lm_head"),
        ("q_norm", "qk_norm"),
        ("k_norm", "qk_norm"),
        ("layernorm", "norm"),
        ("model.norm", "norm"),
        ("mlp.gate.weight", "router"),
        ("experts.gate_up_proj", "experts_w13"),
        ("experts.down_proj", "experts_w2"),
        ("q_proj", "q_proj"),
        ("k_proj", "k_proj"),
        ("v_proj", "v_proj"),
        ("o_proj", "o_proj"),
        ("gate_proj", "dense_gate_up"),
        ("up_proj", "dense_gate_up"),
        ("down_proj", "dense_down"),
    ):
        if key in name:
            return kind
    raise ValueError(f"no tensor type for {name!r}")


def _engine_fp8_layout(params: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
    """vLLM's FP8 engine tensors (tp 1): name -> (type, high-precision value, 2-D or 3-D)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    layers = sorted({int(n.split(".")[2]) for n in params if n.startswith("model.layers.")})
    for i in layers:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[a + "qkv_proj"] = (
            "qkv_proj",
            torch.cat(
                [
                    params[a + "q_proj.weight"],
                    params[a + "k_proj.weight"],
                    params[a + "v_proj.weight"],
                ]
            ),
        )
        out[a + "o_proj"] = ("o_proj", params[a + "o_proj.weight"])
        m = p + "mlp."
        if m + "gate_proj.weight" in params:
            out[m + "gate_up_proj"] = (
                "dense_gate_up",
                torch.cat([params[m + "gate_proj.weight"], params[m + "up_proj.weight"]]),
            )
            out[m + "down_proj"] = ("dense_down", params[m + "down_proj.weight"])
        else:
            out[m + "experts.w13"] = ("experts_w13", params[m + "experts.gate_up_proj"])
            out[m + "experts.w2"] = ("experts_w2", params[m + "experts.down_proj"])
    return out


def _blocks_changed(changed: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    """(blocks with any change, blocks) over the last two dims of a bool mask."""
    t = changed if changed.dim() >= 2 else changed.reshape(1, -1)
    *lead, rows, cols = t.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.nn.functional.pad(t, (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    anyb = padded.reshape(*lead, nr, block[0], nc, block[1]).any(dim=-1).any(dim=-2)
    return int(anyb.sum()), anyb.numel()


class _Acc:
    """Per tensor type, per step: counts that add up over the tensors of the type."""

    def __init__(self) -> None:
        self.c: dict[str, float] = defaultdict(float)

    def add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.c[k] += v


def _bf16_step(
    prev: dict[str, torch.Tensor],
    now: dict[str, torch.Tensor],
    master: dict[str, torch.Tensor],
    delta_fp32: dict[str, torch.Tensor],
) -> dict[str, dict[str, float]]:
    acc: dict[str, _Acc] = defaultdict(_Acc)
    for name, new in now.items():
        old = prev[name]
        changed = old.view(torch.int16) != new.view(torch.int16)
        n = int(changed.sum())
        kind = _kind(name)
        blocks, nblocks = _blocks_changed(changed)
        w = master[name].abs().clamp_min(1e-30)
        ulp = torch.exp2(torch.floor(torch.log2(w)) - 7)
        predicted = float((delta_fp32[name].abs() / ulp).clamp(max=1.0).sum())
        sizes = {e: encoded_nbytes(e, changed, value_bytes=2) for e in ENCODINGS}
        acc[kind].add(
            elements=new.numel(),
            changed=n,
            blocks=nblocks,
            blocks_changed=blocks,
            predicted_changed=predicted,
            full_bytes=2 * new.numel(),
            **{f"wire_{e}": float(s) for e, s in sizes.items()},
        )
    return {k: dict(a.c) for k, a in acc.items()}


def _fp8_step(
    prev: dict[str, tuple[torch.Tensor, torch.Tensor]],
    now: dict[str, tuple[torch.Tensor, torch.Tensor]],
    kinds: dict[str, str],
) -> dict[str, dict[str, float]]:
    acc: dict[str, _Acc] = defaultdict(_Acc)
    for name, (q, s) in now.items():
        q0, s0 = prev[name]
        changed = q0.view(torch.uint8) != q.view(torch.uint8)
        s_changed = s0 != s
        n = int(changed.sum())
        blocks, nblocks = _blocks_changed(changed)
        # Blocks whose scale changed, sent whole, plus the changed bytes of the other blocks.
        bs = s_changed.repeat_interleave(128, -2).repeat_interleave(128, -1)[
            ..., : q.shape[-2], : q.shape[-1]
        ]
        outside = changed & ~bs
        scale_block_bytes = (
            float(bs.sum())
            + 4 * int(s_changed.sum())
            + encoded_nbytes("chunk_index16", outside, value_bytes=1)
        )
        sizes = {e: encoded_nbytes(e, changed, value_bytes=1) for e in ENCODINGS}
        acc[kinds[name]].add(
            elements=q.numel(),
            changed=n,
            blocks=nblocks,
            blocks_changed=blocks,
            scales=s.numel(),
            scales_changed=int(s_changed.sum()),
            blocks_scale_changed_bytes_changed=float((changed & bs).sum()),
            full_bytes=q.numel() + 4 * s.numel(),
            wire_scale_blocks=scale_block_bytes,
            **{f"wire_{e}": float(sz) + 4 * s.numel() for e, sz in sizes.items()},
        )
    return {k: dict(a.c) for k, a in acc.items()}


def _quantized(
    layout: dict[str, tuple[str, torch.Tensor]], dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: quantize_fp8_blockwise(t.detach().to(dtype)) for n, (_, t) in layout.items()}


# -- RL steps ---------------------------------------------------------------------------------


def _rl_run(
    cfg: DensityConfig, base: torch.nn.Module, ids: torch.Tensor, lr: float
) -> dict[str, Any]:
    model = copy.deepcopy(base)
    model.train()
    g = torch.Generator().manual_seed(cfg.seed + 7)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    held_out = ids[int(0.9 * ids.numel()) :]

    def snapshot() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        master = {n: p.detach().clone() for n, p in model.named_parameters()}
        return master, {n: t.to(torch.bfloat16) for n, t in master.items()}

    master, bf16 = snapshot()
    layout = _engine_fp8_layout(master)
    kinds = {n: k for n, (k, _) in layout.items()}
    fp8_from_fp32 = _quantized(layout, torch.float32)
    fp8_from_bf16 = _quantized(layout, torch.bfloat16)
    steps: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for step in range(cfg.rl_steps):
        starts = torch.randint(
            0, held_out.numel() - cfg.rl_prompt_len, (cfg.rl_prompts,), generator=g
        )
        prompts = torch.stack([held_out[s : s + cfg.rl_prompt_len] for s in starts.tolist()])
        prompts = prompts.repeat_interleave(cfg.rl_group, dim=0)
        model.eval()
        with torch.no_grad():
            torch.manual_seed(cfg.seed * 1000 + step)
            seqs = typing.cast(Any, model).generate(
                input_ids=prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=cfg.rl_completion_len,
                min_new_tokens=cfg.rl_completion_len,
                pad_token_id=0,
            )
        model.train()
        completion = seqs[:, cfg.rl_prompt_len :]
        # Reward: distinct tokens per completion (a smooth, verifiable signal); GRPO advantages.
        reward = torch.tensor([len(set(c.tolist())) / c.numel() for c in completion])
        grouped = reward.view(cfg.rl_prompts, cfg.rl_group)
        adv = (
            (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        ).view(-1)
        logits = model(input_ids=seqs).logits[:, cfg.rl_prompt_len - 1 : -1]
        logp = (
            torch.log_softmax(logits.float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        )
        loss = -(adv.unsqueeze(1) * logp).sum() / completion.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        new_master, new_bf16 = snapshot()
        delta = {n: new_master[n] - master[n] for n in master}
        rec: dict[str, Any] = {
            "step": step + 1,
            "reward_mean": float(reward.mean()),
            "grad_norm": grad_norm,
            "bf16": _bf16_step(bf16, new_bf16, new_master, delta),
        }
        new_layout = _engine_fp8_layout(new_master)
        q32 = _quantized(new_layout, torch.float32)
        q16 = _quantized(new_layout, torch.bfloat16)
        rec["fp8_from_fp32"] = _fp8_step(fp8_from_fp32, q32, kinds)
        rec["fp8_from_bf16"] = _fp8_step(fp8_from_bf16, q16, kinds)
        steps.append(rec)
        master, bf16, fp8_from_fp32, fp8_from_bf16 = new_master, new_bf16, q32, q16
        tot = {k: sum(v[k] for v in rec["bf16"].values()) for k in ("changed", "elements")}
        _log(
            f"lr {lr:g} step {step + 1}: bf16 changed {tot['changed'] / tot['elements']:.4%}, "
            f"reward {rec['reward_mean']:.3f} ({time.perf_counter() - t0:.0f} s)"
        )
    return {"lr": lr, "steps": steps}


def _magnitudes(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    by: dict[str, list[torch.Tensor]] = defaultdict(list)
    for n, p in model.named_parameters():
        by[_kind(n)].append(p.detach().abs().flatten())
    out = {}
    for k, ts in by.items():
        a = torch.cat(ts)
        out[k] = {
            "numel": a.numel(),
            "median_abs": float(a.median()),
            "rms": float(a.pow(2).mean().sqrt()),
            "frac_below_1e-3": float((a < 1e-3).double().mean()),
        }
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run and target, per tensor type: densities over the steps (min / median / max) and
    the wire bytes of each encoding relative to a full update (sums over all steps)."""
    out: dict[str, Any] = {}
    for run in runs:
        per_target: dict[str, Any] = {}
        for target in ("bf16", "fp8_from_fp32", "fp8_from_bf16"):
            kinds = sorted({k for s in run["steps"] for k in s[target]})
            rows: dict[str, Any] = {}
            for kind in [*kinds, "ALL"]:
                per_step = []
                for s in run["steps"]:
                    recs = s[target].values() if kind == "ALL" else [s[target][kind]]
                    tot: dict[str, float] = defaultdict(float)
                    for r in recs:
                        for k, v in r.items():
                            tot[k] += v
                    per_step.append(tot)
                dens = sorted(t["changed"] / t["elements"] for t in per_step)
                row: dict[str, Any] = {
                    "elements": per_step[0]["elements"],
                    "density_min": dens[0],
                    "density_median": dens[len(dens) // 2],
                    "density_max": dens[-1],
                    "blocks_changed_median": sorted(
                        t["blocks_changed"] / t["blocks"] for t in per_step
                    )[len(dens) // 2],
                }
                if target == "bf16":
                    row["predicted_density_median"] = sorted(
                        t["predicted_changed"] / t["elements"] for t in per_step
                    )[len(dens) // 2]
                else:
                    row["scales_changed_median"] = sorted(
                        t["scales_changed"] / t["scales"] for t in per_step
                    )[len(dens) // 2]
                full = sum(t["full_bytes"] for t in per_step)
                wire = {
                    k[5:]: sum(t[k] for t in per_step) / full
                    for k in per_step[0]
                    if k.startswith("wire_")
                }
                row["wire_vs_full"] = wire
                rows[kind] = row
            per_target[target] = rows
        out[f"lr={run['lr']:g}"] = per_target
    return out


def _markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# Delta densities from real optimizer steps (CPU, shared 2-core machine)",
        "",
        f"Command: `{result['command']}`  ",
        (
            f"Date: {result['date']}; torch {result['versions']['torch']}, transformers "
            f"{result['versions']['transformers']}; host {result['host']}."
        ),
        "",
        "## What was run",
        (
            "- Model: Qwen3-MoE architecture (transformers `Qwen3MoeForCausalLM`), hidden "
            f"{cfg['hidden_size']}, {cfg['num_layers']} layers (layer 0 dense SwiGLU, the rest"
            " MoE "
            f"with {cfg['num_experts']} experts, top-2), 8 query / 2 KV heads, untied "
            "embeddings, BPE "
            f"vocabulary {cfg['vocab_size']}; {result['num_params']:,} parameters."
        ),
        (
            f"- Pretrained here ({cfg['pretrain_steps']} AdamW steps, lr "
            f"{cfg['pretrain_lr']:g} "
            f"cosine, batch {cfg['pretrain_batch']} x {cfg['seq_len']} tokens) on the Python "
            "standard "
            f"library's sources: loss {result['pretrain']['first_loss']:.2f} -> "
            f"{result['pretrain']['final_loss_mean_last20']:.2f} nats/token (unigram entropy "
            f"{result['pretrain']['unigram_entropy_nats']:.2f})."
        ),
        (
            "- RL: fresh AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0.01, clip 1.0, fp32 "
            "master "
            f"weights), {cfg['rl_steps']} on-policy GRPO-style steps per learning rate "
            f"({cfg['rl_prompts']} prompts x {cfg['rl_group']} samples, "
            f"{cfg['rl_completion_len']} "
            "sampled tokens, group-normalised reward)."
        ),
        (
            "- Why not a real checkpoint: no package on PyPI or Debian that the lists here "
            "name ships"
            " trained LM weights inside the package (checked: the venv's site-packages holds "
            "no model"
            " file; `tinymodel` and `nedb-cast-slm` wheels download their weights; Debian has"
            " no "
            "neural LM package), and hub downloads fail here. A model this small, briefly "
            "trained, "
            "has a weight-magnitude distribution that differs from an 8B model's: the table of "
            "magnitudes below and the density model (`predicted`) let a reader carry the "
            "numbers "
            "over."
        ),
        "",
        (
            "Density of a BF16 target is governed by |update| / ulp(bf16(w)): the `predicted`"
            " column "
            "is sum(min(1, |dw| / ulp(w))) over the elements of the fp32 step, the expected "
            "number of"
            " bf16 roundings that flip when the fp32 value sits uniformly inside its rounding "
            "interval."
        ),
        "",
    ]
    lines.append("## Weight magnitudes of the pretrained checkpoint")
    lines.append("| type | elements | median abs | rms | fraction < 1e-3 |")
    lines.append("|---|---|---|---|---|")
    for k, m in sorted(result["magnitudes"].items()):
        lines.append(
            f"| {k} | {m['numel']:,} | {m['median_abs']:.3g} | {m['rms']:.3g} | "
            f"{m['frac_below_1e-3']:.2%} |"
        )
    lines.append("")
    for run_key, per_target in result["summary"].items():
        for target, rows in per_target.items():
            title = {
                "bf16": "BF16 engine",
                "fp8_from_fp32": "FP8 engine, quantized from the fp32 master",
                "fp8_from_bf16": "FP8 engine, quantized from bf16 parameters",
            }[target]
            lines.append(f"## {run_key}: {title}")
            encs = list(next(iter(rows.values()))["wire_vs_full"])
            extra = "predicted median" if target == "bf16" else "scales changed (median)"
            lines.append(
                "| type | elements | changed: min / median / max | "
                + extra
                + " | 128x128 blocks changed (median) | "
                + " | ".join(f"wire {e}" for e in encs)
                + " |"
            )
            lines.append("|---" * (5 + len(encs)) + "|")
            for kind, r in rows.items():
                ex = r.get("predicted_density_median", r.get("scales_changed_median", 0.0))
                lines.append(
                    f"| {kind} | {int(r['elements']):,} | {r['density_min']:.3%} / "
                    f"{r['density_median']:.3%} / {r['density_max']:.3%} | {ex:.3%} | "
                    f"{r['blocks_changed_median']:.1%} | "
                    + " | ".join(f"{r['wire_vs_full'][e]:.2%}" for e in encs)
                    + " |"
                )
            lines.append("")
    lines.append(
        "Wire columns: bytes the encoding puts on the wire over all steps, relative to full "
        "updates of the same tensors (FP8: every scale sent each step in all but "
        "`scale_blocks`)."
        " Encodings: `weight_transfer.kernels.delta` docstring."
    )
    return "\n".join(lines) + "\n"


# -- encode / apply costs of the encodings (CPU, torch ops) ---------------------------------


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    pad = (-mask.numel()) % 8
    m = torch.nn.functional.pad(mask, (0, pad)).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (m * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return ((bits.unsqueeze(1) & weights) != 0).view(-1)[:numel]


def _encoders() -> dict[str, tuple[Any, Any]]:
    """name -> (encode(new, old) -> patch, apply(dst, patch)) on flat int16 views, torch ops.
    `chunk_index16` is the project's kernel (`weight_transfer.kernels.delta`, CPU path); the
    others are straightforward torch versions of the alternatives, for comparison."""
    from weight_transfer.kernels import delta as k

    def enc_chunk16(new: torch.Tensor, old: torch.Tensor) -> Any:
        n = new.numel()
        offsets = torch.empty(k.num_chunks(n) + 1, dtype=torch.int64)
        # Capacity as the runtime sizes it: the sparse list is used only while it is smaller
        # than the dense run.
        cap = n // 2
        index = torch.empty(cap, dtype=torch.int16)
        values = torch.empty(cap, dtype=new.dtype)
        total = k.diff_encode(new, old, index=index, values=values, offsets=offsets)
        return offsets, index[:total], values[:total]

    def app_chunk16(dst: torch.Tensor, p: Any) -> None:
        k.apply_changes(dst, *p)

    def enc_index32(new: torch.Tensor, old: torch.Tensor) -> Any:
        idx = (new != old).nonzero().view(-1)
        return idx.to(torch.int32), new[idx]

    def app_index32(dst: torch.Tensor, p: Any) -> None:
        dst[p[0].to(torch.int64)] = p[1]

    def enc_bitmap(new: torch.Tensor, old: torch.Tensor) -> Any:
        mask = new != old
        return _pack_bits(mask), new[mask]

    def app_bitmap(dst: torch.Tensor, p: Any) -> None:
        dst[_unpack_bits(p[0], dst.numel())] = p[1]

    def enc_runs256(new: torch.Tensor, old: torch.Tensor) -> Any:
        runs = (new != old).view(-1, 256).any(dim=1)
        return runs, new.view(-1, 256)[runs]

    def app_runs256(dst: torch.Tensor, p: Any) -> None:
        dst.view(-1, 256)[p[0]] = p[1]

    return {
        "chunk_index16": (enc_chunk16, app_chunk16),
        "index32": (enc_index32, app_index32),
        "bitmap": (enc_bitmap, app_bitmap),
        "runs256": (enc_runs256, app_runs256),
    }


def measure_costs(cfg: DensityConfig) -> dict[str, Any]:
    """Encode and apply seconds of each encoding on a BF16 tensor at each density (median of
    `cost_repeats` after a warm-up), every round trip checked bit-exact, beside a plain copy of
    the same tensor measured in the same run (the memory-speed reference)."""
    torch.set_num_threads(cfg.threads)
    g = torch.Generator().manual_seed(cfg.seed)
    n = cfg.cost_numel - cfg.cost_numel % 256
    old = torch.randn(n, generator=g).to(torch.bfloat16).view(torch.int16)
    rows = []
    copy_dst = torch.empty_like(old)

    def timed(fn: Any) -> float:
        fn()
        ts = []
        for _ in range(cfg.cost_repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    copy_s = timed(lambda: copy_dst.copy_(old))
    for density in cfg.cost_densities:
        new = old.clone()
        mask = torch.rand(n, generator=g) < density
        new[mask] = new[mask] ^ 1  # flip the lowest mantissa bit: the size of an RL step
        for name, (enc, app) in _encoders().items():
            patch = enc(new, old)
            dst = old.clone()
            app(dst, patch)
            assert torch.equal(dst, new), f"{name} at {density}: round trip not bit-exact"
            enc_s = timed(lambda enc=enc, new=new: enc(new, old))
            # Applying a patch twice gives the same bytes: time it on the same destination.
            app_s = timed(lambda app=app, patch=patch, dst=dst: app(dst, patch))
            nbytes = sum(t.numel() * t.element_size() for t in patch)
            rows.append(
                {
                    "density": density,
                    "encoding": name,
                    "wire_bytes": nbytes,
                    "wire_vs_full": nbytes / (2 * n),
                    "encode_s": enc_s,
                    "apply_s": app_s,
                    "encode_vs_copy": enc_s / copy_s,
                    "apply_vs_copy": app_s / copy_s,
                }
            )
            _log(
                f"{name} at {density:g}: wire {nbytes / (2 * n):.2%}, encode {enc_s * 1e3:.1f}"
                " ms,"
                f" apply {rows[-1]['apply_s'] * 1e3:.1f} ms"
            )
    return {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "numel": n,
        "copy_s": copy_s,
        "threads": cfg.threads,
        "rows": rows,
    }


def _costs_markdown(costs: dict[str, Any]) -> str:
    lines = [
        (
            f"Encode/apply costs on the CPU (shared 2-core machine, {costs['threads']} "
            "threads; not a "
            f"benchmark result), BF16 tensor of {costs['numel']:,} elements; a plain copy of "
            "it took "
            f"{costs['copy_s'] * 1e3:.1f} ms."
        ),
        f"Command: `{costs['command']}`",
        "",
        (
            "| density | encoding | wire / full | encode ms | apply ms | encode / copy | "
            "apply / copy"
            " |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in costs["rows"]:
        lines.append(
            f"| {r['density']:g} | {r['encoding']} | {r['wire_vs_full']:.2%} | "
            f"{r['encode_s'] * 1e3:.1f}"
            f" | {r['apply_s'] * 1e3:.1f} | {r['encode_vs_copy']:.1f}x | "
            f"{r['apply_vs_copy']:.1f}x"
            " |"
        )
    return "\n".join(lines) + "\n"


def run(cfg: DensityConfig) -> dict[str, Any]:
    """Pretrain (or load), then the RL runs; returns everything measured."""
    torch.set_num_threads(cfg.threads)
    text = _corpus(cfg)
    _log(f"corpus: {len(text):,} characters")
    ids, _ = _tokenize(cfg, text)
    _log(f"tokens: {ids.numel():,}")
    model = _model(cfg, cfg.vocab_size)
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint else None
    if ckpt is not None and ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["state"])
        pre = saved["pretrain"]
    else:
        pre = _pretrain(cfg, model, ids[: int(0.9 * ids.numel())])
        if ckpt is not None:
            torch.save({"state": model.state_dict(), "pretrain": pre}, ckpt)
    runs = [_rl_run(cfg, model, ids, lr) for lr in cfg.rl_lrs]
    import transformers

    result = {
        "config": dataclasses.asdict(cfg),
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "host": f"{platform.machine()}, {torch.get_num_threads()} threads (shared machine)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "num_params": sum(p.numel() for p in model.parameters()),
        "pretrain": pre,
        "magnitudes": _magnitudes(model),
        "runs": runs,
        "summary": summarize(runs),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI entry: argparse -> `DensityConfig` -> run -> JSON / markdown."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(DensityConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("rl_lrs", "cost_densities"):
            p.add_argument(flag, type=float, nargs="+", default=list(f.default))  # type: ignore[arg-type]
        elif f.type in ("str | None",):
            p.add_argument(flag, default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    ns = vars(p.parse_args(argv))
    ns["rl_lrs"] = tuple(ns["rl_lrs"])
    ns["cost_densities"] = tuple(ns["cost_densities"])
    cfg = DensityConfig(**ns)
    if cfg.cost_densities:
        costs = measure_costs(cfg)
        if cfg.json_path:
            Path(cfg.json_path).write_text(json.dumps(costs, indent=1))
        if cfg.md_path:
            Path(cfg.md_path).write_text(_costs_markdown(costs))
        print(json.dumps(costs["rows"], indent=1))
        return 0
    result = run(cfg)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(result, indent=1))
    if cfg.md_path:
        Path(cfg.md_path).write_text(_markdown(result))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
