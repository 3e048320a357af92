"""Does vLLM's batching of one `generate` call move logprobs? (A probe, not a test.)

One vanilla `vllm.LLM` (no plug-in) on the tiny DeepSeek-V3 of test_vllm_mla.py generates the
prompts of test_vllm_engine.py several times, weights untouched: batched (one `generate` call
with all prompts, as `_generate` did before), one request per call (as `_generate` does now), and
staggered (the first request alone for a second). The worker logs each step's scheduled tokens
per request. Prints the batches and which logprobs (prompt, then sampled, per prompt) differ from
the first batched run. docs/vllm.md ("The one-ulp failures") quotes its output. Which requests
share a step depends on timing, so the batched runs are not reproducible by design.

    python -m tests.integration.vllm_batch_probe [--dir /tmp/vllm_batch_probe]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _log_steps(self: Any) -> None:
    """Worker side: record the scheduled tokens per request of every step."""
    if getattr(self, "_probe_steps", None) is not None:
        return
    self._probe_steps = []
    inner = self.execute_model

    def logged(scheduler_output: Any, *a: Any, **k: Any) -> Any:
        n = getattr(scheduler_output, "num_scheduled_tokens", None)
        if n:
            self._probe_steps.append(sorted(n.values()))
        return inner(scheduler_output, *a, **k)

    self.execute_model = logged


def _take_steps(self: Any) -> list[list[int]]:
    steps: list[list[int]] = self._probe_steps
    self._probe_steps = []
    return steps


def main() -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.integration.test_vllm_engine import MAX_TOKENS, PROMPTS, _prompt_logprobs, _start_llm
    from tests.integration.test_vllm_mla import DEEPSEEK_V3, MLA_LLM_KWARGS, _save

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/vllm_batch_probe")
    args = ap.parse_args()
    d = _save(Path(args.dir), "DeepseekV3ForCausalLM", DEEPSEEK_V3, torch.float32, 0)
    llm = _start_llm(d, "float32", 1, backend=False, **MLA_LLM_KWARGS)
    llm.collective_rpc(_log_steps)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0, logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]

    def batched() -> list[Any]:
        return list(llm.generate(prompts, sp, use_tqdm=False))

    def single() -> list[Any]:
        return [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]

    def staggered() -> list[Any]:
        eng, outs = llm.llm_engine, {}
        for i, p in enumerate(prompts):
            eng.add_request(f"probe-{time.monotonic_ns()}-{i}", p, sp)
            if i == 0:
                time.sleep(1.0)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[int(o.request_id.rsplit("-", 1)[1])] = o
        return [outs[i] for i in range(len(prompts))]

    def values(o: Any) -> list[float]:
        out = o.outputs[0]
        sampled = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        return _prompt_logprobs(o) + sampled

    runs: dict[str, list[list[float]]] = {}
    try:
        for name, f in [
            ("batched1", batched),
            ("single1", single),
            ("batched2", batched),
            ("staggered", staggered),
            ("single2", single),
            ("batched3", batched),
        ]:
            runs[name] = [values(o) for o in f()]
            (steps,) = llm.collective_rpc(_take_steps)
            print(f"{name}: first steps {steps[:3]}, {len(steps)} steps")
    finally:
        llm.llm_engine.engine_core.shutdown()
    print("single1 == single2:", runs["single1"] == runs["single2"])
    ref = runs["batched1"]
    for name, v in runs.items():
        diffs = [
            (i, j, a, b)
            for i, (ra, rb) in enumerate(zip(v, ref, strict=True))
            for j, (a, b) in enumerate(zip(ra, rb, strict=True))
            if a != b
        ]
        print(f"{name} vs batched1: {len(diffs)} of {sum(map(len, ref))} differ {diffs[:4]}")


if __name__ == "__main__":
    main()
