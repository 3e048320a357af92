"""How much memory `weight-transfer demo` needs, estimated before any process starts.

The demo runs every process on this host, and a preset is only a shape: `--model llama-3.1-8b`
trains a randomly initialised 8B-parameter model in each of its trainer processes. What the
processes hold at their peak, as the demo is written (`cli/run_demo.py`):

* every trainer rank builds the whole model in float32 first (transformers' default), then
  converts it and shards it with FSDP2: 4 bytes per parameter, on every rank at once;
* then, per trainer rank: its shard of the parameters, their gradients and AdamW's two states
  (4 x parameters x dtype size / ranks), plus the whole model again each update, because every
  rank calls `full_tensor()` on every parameter for the verification; rank 0 also materialises
  what every engine should hold (the engines' bytes);
* per trainer rank the transfer's memory budget (`PlannerConfig.memory_budget_bytes`: staging
  arena and scratch);
* the engines' tensors (vLLM layout, all tensor-parallel ranks together);
* about `PROCESS_BASE_BYTES` per process for Python, torch and transformers themselves.

The estimate is compared with the memory the kernel says is available (`MemAvailable` in
/proc/meminfo); the demo refuses when it does not fit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PROCESS_BASE_BYTES = 500 << 20
"""Memory of one demo process beside its weights and staging. Measured on the project's 2-core
CPU machine (2026-12, torch 2.13.0+cpu, shared with other jobs): a process that imported torch,
transformers and this package held 415 MB (Pss, /proc/self/smaps_rollup); a whole `weight-transfer
demo` (tiny model) peaked at 3.22 GiB Pss over its process tree, the CLI process and the three
128 MiB staging arenas included: about 0.49 GiB for each of its 5 processes."""

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """The demo's estimated peak memory, by part (bytes)."""

    parts: tuple[tuple[str, int], ...]
    """(what, bytes), summed over the processes that hold it."""

    @property
    def total_bytes(self) -> int:
        """Sum of the parts."""
        return sum(b for _, b in self.parts)


def estimate(cfg: Any) -> MemoryEstimate:
    """The peak memory `run_demo(cfg)` needs on this host (see the module docstring).

    Args:
        cfg: a `run_demo.DemoConfig` whose model and engine layout preflight accepted.
    """
    from weight_transfer.planner.presets.models import get_model_shape, num_parameters
    from weight_transfer.planner.presets.vllm import vllm_tensor_specs

    shape = get_model_shape(cfg.model)
    n, m = cfg.train_ranks, cfg.engine_ranks
    params = num_parameters(shape)
    dtype_bytes = _DTYPE_BYTES[cfg.trainer_dtype]
    model_bytes = params * dtype_bytes
    engine_bytes = 0
    for r, fp8 in ((e % m, cfg.replicas[e // m]) for e in range(cfg.num_engines)):
        for s in vllm_tensor_specs(shape, r, m, fp8=fp8, param_dtype=cfg.engine_dtype):
            count = 1
            for d in s.shape:
                count *= d
            engine_bytes += count * (1 if s.dtype.startswith("float8") else _DTYPE_BYTES[s.dtype])
    build = 4 * params  # float32 construction, before the cast and the sharding
    steady = 4 * model_bytes // n + model_bytes  # shard, grads, AdamW x2; full_tensor() copies
    parts = [
        (
            "trainer ranks: model, gradients, AdamW states, verification copies",
            n * max(build, steady),
        ),
        ("trainer rank 0: expected engine tensors (verification)", engine_bytes),
        ("trainer ranks: transfer memory budget", n * cfg.planner.memory_budget_bytes),
        ("engine ranks: engine tensors", engine_bytes),
        ("processes: Python, torch, transformers", (n + m) * PROCESS_BASE_BYTES),
    ]
    if cfg.engine_model == "phi3":
        parts.append(("trainer rank 0: reference model (logits)", model_bytes))
    return MemoryEstimate(parts=tuple(parts))


def available_bytes() -> int | None:
    """Memory available for new processes (`MemAvailable` of /proc/meminfo), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def memory_problem(cfg: Any, available: int | None = None) -> str | None:
    """Why the demo `cfg` does not fit in this host's available memory (one line), or None.

    Args:
        available: bytes available (default: `available_bytes()`; None there: not checked).
    """
    have = available_bytes() if available is None else available
    if have is None:
        return None
    est = estimate(cfg)
    if est.total_bytes <= have:
        return None
    biggest = max(est.parts, key=lambda p: p[1])
    return (
        f"--model {cfg.model} with {cfg.train_ranks} trainer and {cfg.engine_ranks} engine "
        f"processes needs about {_gib(est.total_bytes)} of memory on this host, "
        f"{_gib(have)} is available (largest part: {biggest[0]}, {_gib(biggest[1])}); "
        "presets are full-size shapes with random weights: use --model tiny, or a host with "
        "more memory"
    )
