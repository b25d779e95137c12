"""In one process, a float32 model's decode steps of ROWS sequences with its products by 1024 inputs or more
taken in C up to each of two row counts (the C kernel's own limit, kernels.c's DENSE_FLOAT32_ROWS, and 12,
the limit on AMD Zen 4 from 5 to 6 December; above the limit oneDNN's prepacked product multiplies them),
switched every ROUND_TOKENS tokens for ROUNDS rounds (benchmarks/step_timing.py) so that the machine's
drift falls on both alike; prints each limit's median decode step and whether both generated the same
greedy tokens.

    flock /tmp/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/float32_rows_ab.py 16 [MODEL]

MODEL: default builtin:llama-1b.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from benchmarks.step_timing import ROUND_TOKENS, ROUNDS, alternate  # noqa: E402
from inflight.checkpoints.resolve import resolve_model  # noqa: E402
from inflight.engine.cpu.linear import PrepackedLinear  # noqa: E402
from inflight.engine.llm import LLM  # noqa: E402

LIMITS = (24, 12)  # DENSE_FLOAT32_ROWS; oneDNN from 13 rows
BLOCKED_INPUTS = 1024  # DENSE_BLOCKED_K


def limit_rows(llm: LLM, limit: int) -> None:
    """Make every product by BLOCKED_INPUTS or more inputs, and every one-call decoder layer, take up to
    `limit` rows in C (the products' own dense_rows stay for fewer inputs)."""
    model = llm.engine.model
    for module in model.modules():
        if isinstance(module, PrepackedLinear) and module.in_features >= BLOCKED_INPUTS and module.dense_rows:
            module.dense_rows = limit
    for layer in model.layers:
        fused = layer.fused()
        if fused is not None:
            fused.max_rows = limit


def main() -> None:
    rows = int(sys.argv[1])
    path = resolve_model(sys.argv[2] if len(sys.argv) > 2 else "builtin:llama-1b")
    torch.set_num_threads(2)
    llm = LLM(path, max_slots=rows, dtype="float32", quantization="none")
    variants = {f"up to {limit} rows in C": functools.partial(limit_rows, llm, limit) for limit in LIMITS}
    result = alternate(llm, rows, variants)
    print(
        f"{path.name} float32, rows={rows}, {ROUNDS} rounds of {ROUND_TOKENS} tokens alternated, "
        f"same tokens: {result.same_tokens}"
    )
    for name, seconds in result.seconds.items():
        print(f"  {name}: median decode step {statistics.median(seconds) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
