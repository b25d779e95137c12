"""Where an offline run goes, step by step: the `bench offline` workload through inflight's continuous
engine (after its warm-up) with wall-clock timers on each engine step (grouped by kind: prefill or
decode, and by how many rows it runs), the linear layers (by weight shape and row bucket; float weights
and weights kept quantized, "qlinear") and the LM head.

    PYTHONPATH=. .venv/bin/python benchmarks/offline_profile.py \
        --model builtin:llama-1b --dtype bfloat16 --num-requests 16 [--quantization none]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from typing import Any

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from inflight.bench.checkpoint import bench_checkpoint, inflight_checkpoint  # noqa: E402
from inflight.bench.inflight_engine import CONTINUOUS  # noqa: E402
from inflight.bench.system import BenchSettings  # noqa: E402
from inflight.bench.workload import load_workload  # noqa: E402
from inflight.engine import runner as runner_module  # noqa: E402
from inflight.engine.cpu import linear, quantized  # noqa: E402
from inflight.engine.model import llama  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
ROW_BUCKETS = (1, 4, 8, 16, 64, 256, 1024, 2048)


def bucket(rows: int) -> str:
    for top in ROW_BUCKETS:
        if rows <= top:
            return f"<={top}"
    return f">{ROW_BUCKETS[-1]}"


def add(name: str, seconds: float) -> None:
    TIMES[name] += seconds
    CALLS[name] += 1


def install() -> None:
    execute = runner_module.ModelRunner.execute
    forward = linear.PrepackedLinear.forward
    quantized_forward = quantized.QuantizedLinear.forward
    logits = llama.LlamaForCausalLM.compute_logits

    def timed_execute(self: Any, out: Any) -> Any:
        start = time.perf_counter()
        result = execute(self, out)
        prompt = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        decode = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        kind = f"step prefill {bucket(prompt)} tokens" if prompt else f"step decode {bucket(decode)} rows"
        add(kind, time.perf_counter() - start)
        return result

    def timed_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = forward(self, x)
        add(
            f"  linear {self.out_features}x{self.in_features} rows {bucket(x.shape[0])}",
            time.perf_counter() - start,
        )
        return y

    def timed_quantized_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = quantized_forward(self, x)
        rows = x.reshape(-1, self.in_features).shape[0]
        add(
            f"  qlinear {self.out_features}x{self.in_features} rows {bucket(rows)}",
            time.perf_counter() - start,
        )
        return y

    def timed_logits(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = logits(self, hidden)
        add(f"  compute_logits rows {bucket(hidden.shape[0])}", time.perf_counter() - start)
        return y

    runner_module.ModelRunner.execute = timed_execute  # type: ignore[method-assign]
    linear.PrepackedLinear.forward = timed_forward  # type: ignore[method-assign]
    quantized.QuantizedLinear.forward = timed_quantized_forward  # type: ignore[method-assign]
    llama.LlamaForCausalLM.compute_logits = timed_logits  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    install()
    model = bench_checkpoint(args.model)
    settings = BenchSettings(
        model_dir=model,
        requests=load_workload(model, args.num_requests, workload=args.workload),
        max_slots=64,
        dtype=args.dtype,
        vllm_python=None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.threads,
        quantization=args.quantization,
        inflight_model=inflight_checkpoint(args.model, model, args.quantization),
    )
    CONTINUOUS.run(settings)
    TIMES.clear()
    CALLS.clear()
    run = CONTINUOUS.run(settings)
    tokens = sum(map(len, run.outputs))
    prompt = sum(len(r.prompt_token_ids) for r in settings.requests)
    print(f"{args.model} {args.dtype}, {args.num_requests} requests ({prompt} prompt tokens, {tokens} out):")
    print(f"  {run.seconds:.2f} s, {tokens / run.seconds:.1f} tok/s")
    for name, seconds in sorted(TIMES.items()):
        share = 100 * seconds / run.seconds
        per = 1000 * seconds / CALLS[name]
        print(f"  {name:52s} {seconds:7.2f} s {share:5.1f} % {CALLS[name]:6d} calls {per:8.2f} ms")


if __name__ == "__main__":
    main()
