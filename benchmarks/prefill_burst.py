"""Prompts that arrive together: the first four requests of `inflight bench serve`'s workload (seed 0:
prompts of 232, 120, 50 and 54 tokens, 12 greedy tokens each) added to an engine at once, every
`engine.step()` timed. Prints when each request got its first token and each step's time and tokens, for
a `max_merged_prefill_tokens` (0: merge every prompt into one step while the budget lasts). One untimed
round first. Point PYTHONPATH at a checkout to measure that version (the TTFT work of #29,
docs/benchmarks.md).

    PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/prefill_burst.py float32|bfloat16 64,0
"""

from __future__ import annotations

import os
import sys
import time

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from inflight.bench.checkpoint import bench_checkpoint  # noqa: E402
from inflight.bench.workload import load_workload  # noqa: E402
from inflight.checkpoints.resolve import resolve_model  # noqa: E402
from inflight.engine.config import EngineConfig  # noqa: E402
from inflight.engine.engine import LLMEngine  # noqa: E402
from inflight.engine.sequence import SamplingParams  # noqa: E402


def burst(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[dict[str, float], list[str]]:
    """First-token times (s after the prompts were added) by request id, and each step as 'ms/tokens'."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    steps = []
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        outputs = engine.step()
        after = time.perf_counter()
        steps.append(f"{(after - before) * 1e3:.0f}/{engine.stats().last_step_num_batched_tokens}")
        for output in outputs:
            if output.outputs[0].token_ids:
                first.setdefault(output.request_id, after - started)
    return first, steps


def main() -> None:
    dtype, limits = sys.argv[1], [int(limit) for limit in sys.argv[2].split(",")]
    torch.set_num_threads(2)
    prompts = [r.prompt_token_ids for r in load_workload(bench_checkpoint("builtin:smollm2"), 8, 0)[:4]]
    for limit in limits:
        config = EngineConfig(
            dtype=dtype,
            device="cpu",
            quantization="none",
            enable_prefix_caching=False,
            max_merged_prefill_tokens=limit,
        )
        engine = LLMEngine(resolve_model("builtin:smollm2"), config)
        burst(engine, prompts, "warm-up")
        first, steps = burst(engine, prompts, "timed")
        firsts = ", ".join(f"{len(prompts[i])}: {first[f'timed-{i}'] * 1e3:.0f}" for i in range(len(prompts)))
        total = sum(float(step.split("/")[0]) for step in steps)
        print(
            f"{dtype}, max_merged_prefill_tokens {limit}: first token (prompt tokens: ms) {firsts}; "
            f"steps (ms/tokens) {' '.join(steps[:6])} ...; all steps {total:.0f} ms"
        )


if __name__ == "__main__":
    main()
