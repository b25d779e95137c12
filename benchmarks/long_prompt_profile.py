"""Where a long-prompt run goes: the `long-prompts` bench workload through inflight's continuous engine
(its timed generate, after the model's load and warm-up), with per-call timers on the linear layers
(oneDNN GEMMs), paged attention and the K/V writes; the rest of the timed run is the elementwise steps,
sampling and Python.

    PYTHONPATH=. .venv/bin/python benchmarks/long_prompt_profile.py \
        [--model builtin:smollm2] [--dtype bfloat16] [--num-requests 16] [--threads 2]
        [--max-num-batched-tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

import torch  # noqa: E402

from inflight import LLM  # noqa: E402
from inflight.bench.checkpoint import bench_checkpoint  # noqa: E402
from inflight.bench.inflight_engine import CONTINUOUS  # noqa: E402
from inflight.bench.system import BenchSettings  # noqa: E402
from inflight.bench.workload import load_workload  # noqa: E402
from inflight.engine.attention import backend  # noqa: E402
from inflight.engine.cpu import kernels as cpu_kernels  # noqa: E402
from inflight.engine.cpu import linear  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
# The C calls inside attention (prefill and decode steps alike), printed after the rest.
INSIDE = "  attention's "
CALLS: dict[str, int] = defaultdict(int)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        TIMES[name] += time.perf_counter() - start
        CALLS[name] += 1
        return out

    return wrapper


def prompt_rows(meta: Any) -> str:
    """'prefill' when the call has prompt rows, else 'decode'."""
    return "prefill" if meta.prompts.shape[0] else "decode"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = backend.CPU_KERNEL_BACKEND
    attention = kernel.paged_attention

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, scale: float) -> torch.Tensor:
        return timed(f"attention ({prompt_rows(meta)} steps)", attention)(q, k, v, meta, scale)

    backend.CPU_KERNEL_BACKEND = backend.AttentionBackend(
        kernel.name, timed("K/V writes", kernel.write_kv_cache), attend
    )
    # Inside attention, both kinds of step: the C calls for prompt rows and for decode rows.
    library = cpu_kernels.library()
    if library is not None:
        library.paged_prefill = timed(INSIDE + "prompt rows (C)", library.paged_prefill)
        library.paged_decode = timed(INSIDE + "decode rows (C)", library.paged_decode)
    linear.PrepackedLinear.forward = timed("linear (oneDNN)", linear.PrepackedLinear.forward)  # type: ignore[method-assign]
    torch.nn.Linear.forward = timed("linear (torch)", torch.nn.Linear.forward)  # type: ignore[method-assign]
    model = bench_checkpoint(args.model)
    settings = BenchSettings(
        model_dir=model,
        requests=load_workload(model, args.num_requests, workload="long-prompts"),
        max_slots=64,
        dtype=args.dtype,
        vllm_python=None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.threads,
    )
    # Only the timed generate counts: the timers restart as it begins, after the model's load, the oneDNN
    # warm-up of every batch size and the warm-up step (those run products too: on llama-1b, 15 % of the
    # run's time again).
    generate = LLM.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        TIMES.clear()
        CALLS.clear()
        return generate(*args, **kwargs)

    LLM.generate = timed_generate  # type: ignore[method-assign]
    run = CONTINUOUS.run(settings)
    tokens = sum(map(len, run.outputs))
    prompt = sum(len(r.prompt_token_ids) for r in settings.requests)
    chunk = args.max_num_batched_tokens
    print(
        f"{args.model}, {args.dtype}, {args.num_requests} requests ({prompt} prompt tokens, {tokens} out), "
        f"chunk {chunk}:"
    )
    print(f"  {run.seconds:.2f} s, {tokens / run.seconds:.1f} tok/s")
    # The step kinds' timers by time, the rest, then the C calls inside their attention.
    ordered = sorted(TIMES.items(), key=lambda kv: (kv[0].startswith(INSIDE), -kv[1]))
    rest = run.seconds - sum(seconds for name, seconds in TIMES.items() if not name.startswith(INSIDE))
    ordered.insert(sum(not name.startswith(INSIDE) for name, _ in ordered), ("rest", rest))
    for name, seconds in ordered:
        calls = f"  {CALLS[name]} calls" if name in CALLS else ""
        print(f"  {name:32s} {seconds:7.2f} s  {100 * seconds / run.seconds:5.1f} %{calls}")


if __name__ == "__main__":
    main()
