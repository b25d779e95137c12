"""The median decode step of `builtin:smollm2` (or the model named third) with float weights
(`--quantization none`) at a few batch sizes: for each size, that many requests (64-token prompts, 80
greedy tokens) added at once to an engine of 64 slots, every `engine.step()` timed; the median leaves out
the first two (prefill) and last two.
Point PYTHONPATH at a checkout to measure that version (the float-weight A/B of #29, docs/benchmarks.md).

    PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/decode_step.py float32|bfloat16 1,4 [builtin:llama-1b]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from inflight.checkpoints.resolve import resolve_model  # noqa: E402
from inflight.engine.config import EngineConfig  # noqa: E402
from inflight.engine.engine import LLMEngine  # noqa: E402
from inflight.engine.sequence import SamplingParams  # noqa: E402


def main() -> None:
    dtype, sizes = sys.argv[1], [int(size) for size in sys.argv[2].split(",")]
    torch.set_num_threads(2)
    config = EngineConfig(dtype=dtype, device="cpu", quantization="none", max_num_seqs=64)
    model = sys.argv[3] if len(sys.argv) > 3 else "builtin:smollm2"
    engine = LLMEngine(resolve_model(model), config)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for size in sizes:
        for i in range(size):
            engine.add_request(f"{size}-{i}", [1 + i, 100 + i, 200, 300, 400, 500, 600, 700] * 8, params)
        seconds = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - started)
        decode = sorted(seconds[2:-2])
        print(
            f"{dtype} batch {size}: median step {statistics.median(decode) * 1e3:.2f} ms, "
            f"10th percentile {decode[len(decode) // 10] * 1e3:.2f} ms ({len(decode)} steps)"
        )


if __name__ == "__main__":
    main()
