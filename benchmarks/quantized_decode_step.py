"""One process: the median decode step of a GGUF model kept quantized, as #30's batch-1 figures measure it
(`LLM(..., max_slots=ROWS)`, ROWS prompts of 64 tokens, 128 greedy tokens each, bfloat16, 2 torch
threads), with the process's RSS and a hash of the generated tokens (equal hashes: the same greedy
tokens). Point PYTHONPATH at a checkout to measure that version; alternate checkouts, one process each,
under the exclusive bench lock:

    flock /tmp/bench.lock env PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/quantized_decode_step.py \\
        MODEL [ROWS]

MODEL: a GGUF file or `builtin:smollm2`; ROWS: 1 (default) or more sequences decoding together.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

import inflight
from benchmarks.step_timing import random_prompts
from inflight.bench.system import resident_mib
from inflight.checkpoints.resolve import resolve_model
from inflight.engine.llm import LLM
from inflight.engine.sequence import SamplingParams

OUTPUT_TOKENS = 128


def main() -> None:
    model = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    path = resolve_model(model)
    torch.set_num_threads(2)
    llm = LLM(path, max_slots=rows, dtype="bfloat16")
    loaded_rss = resident_mib()
    prompts = random_prompts(llm, rows)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up

    engine = llm.engine
    step = engine.step
    times: list[tuple[int, float]] = []

    def timed() -> list:  # type: ignore[type-arg]
        start = time.perf_counter()
        out = step()
        times.append((len(engine.scheduler.running), time.perf_counter() - start))
        return out

    engine.step = timed  # type: ignore[method-assign]
    outputs = llm.generate(prompts, params)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    # Decode steps with every sequence running (the prompt steps and the last ones aside).
    decode = [seconds for running, seconds in times[2:] if running == rows] or [s for _, s in times[2:]]
    digest = hashlib.sha256(repr(tokens).encode()).hexdigest()[:12]
    print(
        f"{Path(inflight.__file__).parent.parent} {path.name} rows={rows}: median decode step "
        f"{statistics.median(decode) * 1e3:.2f} ms over {len(decode)} steps, RSS {loaded_rss} MiB "
        f"loaded, {resident_mib()} MiB after, tokens {digest}"
    )


if __name__ == "__main__":
    main()
