"""One process, one timed run: the bench workload (64 requests, `builtin:smollm2`, bfloat16) through
inflight's continuous engine twice, the first untimed (first-run costs), printing the second's output
tokens/s (and per CPU second where the checkout's harness measures it). Point PYTHONPATH at a checkout
to measure that version (the A/B of unconstrained batches against main before #28, docs/api.md); an
optional schema share constrains part of the batch.

    PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/offline_warm_run.py [SHARE]
"""

from __future__ import annotations

import os
import sys

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import inflight  # noqa: E402
from inflight.bench.checkpoint import bench_checkpoint  # noqa: E402
from inflight.bench.inflight_engine import CONTINUOUS  # noqa: E402
from inflight.bench.system import BenchSettings  # noqa: E402
from inflight.bench.workload import load_workload  # noqa: E402


def main() -> None:
    model = bench_checkpoint("builtin:smollm2")
    share = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    # Before #28 load_workload had no schema share: call it the old way for an unconstrained batch.
    requests = load_workload(model, 64, schema_share=share) if share else load_workload(model, 64)
    settings = BenchSettings(
        model_dir=model, requests=requests, max_slots=64, dtype="bfloat16", vllm_python=None,
        max_num_batched_tokens=2048,
    )  # fmt: skip
    speeds = []
    for _ in range(2):
        run = CONTINUOUS.run(settings)
        speeds.append(sum(map(len, run.outputs)) / run.seconds)
    # A checkout whose harness measures CPU time (SystemRun.cpu_seconds) also gets tokens per CPU second.
    cpu_seconds = getattr(run, "cpu_seconds", None)
    per_cpu = f" ({sum(map(len, run.outputs)) / cpu_seconds:.1f} per CPU second)" if cpu_seconds else ""
    timed = f"timed {speeds[1]:.1f} tokens/s{per_cpu}"
    print(f"{inflight.__file__}, share {share}: warm-up {speeds[0]:.1f}, {timed}")


if __name__ == "__main__":
    main()
