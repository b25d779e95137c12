"""What a step's grammar masks cost, outside the model: 64 sampling rows, every other one following the
bench workload's JSON schema (`BENCH_SCHEMA`) over `builtin:smollm2`'s 49152-token vocabulary. Per step:
the mask thread's work (`TokenConstraints.start` until its masks are ready: catching each matcher up with
its output, llguidance's masks) and the engine thread's (`PendingLimits.apply`: the masks on float32
logits). Each guided row then draws a random allowed token, so every step's grammar states are new.
Median and fastest of the steps after the first 5. Point PYTHONPATH at a checkout to measure that version.

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_mask_step.py [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from inflight.engine.cpu import openmp

openmp.configure(os.environ)

import torch  # noqa: E402

from inflight.bench.checkpoint import bench_checkpoint  # noqa: E402
from inflight.bench.workload import BENCH_SCHEMA, vocab_size  # noqa: E402
from inflight.engine.constraints import TokenConstraints  # noqa: E402
from inflight.engine.guided import GrammarCompiler, GrammarMatchers  # noqa: E402
from inflight.engine.sampler import SamplingRow  # noqa: E402
from inflight.engine.sequence import GuidedDecoding, SamplingParams  # noqa: E402
from inflight.engine.tokenizer import Tokenizer  # noqa: E402

ROWS = 64
PROMPT = [5] * 10


def row(k: int, guided: SamplingParams, plain: SamplingParams, outputs: list[list[int]]) -> SamplingRow:
    """Row k of a step: even rows follow the schema (with their output so far), odd rows are plain."""
    if k % 2:
        return SamplingRow(plain, PROMPT, len(PROMPT), 0, 0, frozenset(), f"plain-{k}")
    output = outputs[k // 2]
    return SamplingRow(guided, PROMPT + output, len(PROMPT), 0, len(output), frozenset(), f"guided-{k // 2}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    model_dir = bench_checkpoint("builtin:smollm2")
    vocab = vocab_size(model_dir)
    tokenizer = Tokenizer.from_path(model_dir)
    constraints = TokenConstraints(GrammarMatchers(GrammarCompiler(tokenizer, vocab, tokenizer.all_eos_ids)))
    schema = GuidedDecoding("json_schema", json.dumps(BENCH_SCHEMA))
    guided = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True, guided=schema)
    plain = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    outputs: list[list[int]] = [[] for _ in range(ROWS // 2)]
    rng = random.Random(0)
    mask_thread, engine_thread = [], []
    for _ in range(args.steps):
        rows = [row(k, guided, plain, outputs) for k in range(ROWS)]
        logits = torch.randn(ROWS, vocab)
        start = time.perf_counter()
        pending = constraints.start(rows)
        assert pending.masks is not None
        pending.masks.result()
        mask_thread.append(time.perf_counter() - start)
        start = time.perf_counter()
        limited, failed = pending.apply(logits)
        engine_thread.append(time.perf_counter() - start)
        assert not failed
        for k, output in enumerate(outputs):
            allowed = torch.isfinite(limited[2 * k]).nonzero()[:, 0]
            output.append(int(allowed[rng.randrange(len(allowed))]))
    for name, seconds in (("mask thread", mask_thread), ("engine thread", engine_thread)):
        timed = sorted(seconds[5:])
        print(
            f"{name}: median {timed[len(timed) // 2] * 1e3:.2f} ms, fastest {timed[0] * 1e3:.2f} ms per step"
        )


if __name__ == "__main__":
    main()
