"""What constrained decoding costs a batch: the bench workload with a share of its requests carrying a JSON
schema (`inflight bench ... --schema-share`) against the same workload with none, in one run.

Offline: the inflight engine as `inflight bench offline` runs it (model loaded per run, not timed).
Served: one `inflight serve` (as `inflight bench serve` starts it), the workload's streaming completions
all at once. The two workloads alternate (A,B then B,A ...) so shared-machine noise hits both; per round:
output tokens/s of each and constrained / unconstrained; then the median of the rounds' ratios. The same
ratio of output tokens per CPU second (the engine's process, all its threads, in the timed region) is
printed beside it: on a machine shared with other jobs it moves far less with their load than tokens/s.

    PYTHONPATH=. .venv/bin/python benchmarks/structured_output_cost.py --model builtin:smollm2 \
        [--schema-share 0.5] [--rounds 3] [--modes offline,served] [--dtype auto] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from inflight.engine.cpu import openmp

# The engine's OpenMP spin count, set as the `inflight` command sets it, before torch loads OpenMP.
openmp.configure(os.environ)

from inflight.bench.checkpoint import bench_checkpoint  # noqa: E402
from inflight.bench.inflight_engine import CONTINUOUS  # noqa: E402
from inflight.bench.served import inflight_system, run_clients, wait_until_ready  # noqa: E402
from inflight.bench.system import BenchSettings  # noqa: E402
from inflight.bench.workload import BenchRequest, kv_blocks_for, load_workload  # noqa: E402
from inflight.engine.cli_args import add_batching_args  # noqa: E402
from inflight.engine.cpu.isa import cpu_isa  # noqa: E402
from inflight.engine.dtypes import resolve_dtype_name  # noqa: E402


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# A run's output tokens per second and per CPU second of the engine's process.
Speeds = tuple[float, float]


def offline_runner(args: argparse.Namespace, model_dir: Path) -> Callable[[list[BenchRequest]], Speeds]:
    def run(requests: list[BenchRequest]) -> Speeds:
        settings = BenchSettings(
            model_dir=model_dir,
            requests=requests,
            max_slots=args.max_slots,
            dtype=args.dtype,
            vllm_python=None,
            max_num_batched_tokens=args.max_num_batched_tokens,
            threads=args.threads,
        )
        result = CONTINUOUS.run(settings)
        wrong = [r for out, r in zip(result.outputs, requests, strict=True) if len(out) != r.output_len]
        if wrong:
            raise SystemExit(f"offline: {len(wrong)} requests did not generate their exact length")
        assert result.cpu_seconds is not None
        tokens = sum(len(out) for out in result.outputs)
        return tokens / result.seconds, tokens / result.cpu_seconds

    return run


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served_runner(url: str, pid: int) -> Callable[[list[BenchRequest]], Speeds]:
    def run(requests: list[BenchRequest]) -> Speeds:
        cpu_start = process_cpu_seconds(pid)
        results, seconds = asyncio.run(run_clients(url, "bench", requests, math.inf, 0))
        cpu_seconds = process_cpu_seconds(pid) - cpu_start
        failed = [r.error for r in results if r.error]
        if failed:
            raise SystemExit(f"served: {len(failed)} requests failed, e.g. {failed[0]}")
        tokens = sum(r.output_tokens for r in results)
        return tokens / seconds, tokens / cpu_seconds

    return run


def alternate(name: str, run: Callable[[list[BenchRequest]], Speeds], plain: list[BenchRequest],
              mixed: list[BenchRequest], rounds: int) -> list[float]:  # fmt: skip
    # The first run in a process pays one-time costs (oneDNN primitives for new shapes): untimed.
    say(f"{name} warm-up (untimed): {run(mixed)[0]:.1f} tokens/s")
    ratios, cpu_ratios = [], []
    for index in range(rounds):
        order = [("plain", plain), ("mixed", mixed)]
        speeds = {label: run(requests) for label, requests in (order if index % 2 == 0 else order[::-1])}
        (plain_speed, plain_cpu), (mixed_speed, mixed_cpu) = speeds["plain"], speeds["mixed"]
        ratios.append(mixed_speed / plain_speed)
        cpu_ratios.append(mixed_cpu / plain_cpu)
        say(f"{name} round {index + 1}: no schema {plain_speed:.1f} tokens/s ({plain_cpu:.1f} per CPU "
            f"second), with schemas {mixed_speed:.1f} tokens/s ({mixed_cpu:.1f} per CPU second): "
            f"{ratios[-1]:.3f}x ({cpu_ratios[-1]:.3f}x per CPU second)")  # fmt: skip
    say(f"{name}: median {statistics.median(ratios):.3f}x over {rounds} rounds "
        f"({statistics.median(cpu_ratios):.3f}x per CPU second)")  # fmt: skip
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--schema-share", type=float, default=0.5)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="offline,served")
    parser.add_argument("--dtype", default="auto")
    add_batching_args(parser)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.dtype = resolve_dtype_name(args.dtype, False, native_cpu_bfloat16=cpu_isa().native_bfloat16)
    model_dir = bench_checkpoint(args.model)
    plain = load_workload(model_dir, args.num_requests)
    mixed = load_workload(model_dir, args.num_requests, schema_share=args.schema_share)
    constrained = sum(r.schema is not None for r in mixed)
    say(f"{args.model}, {args.dtype}, {len(plain)} requests ({constrained} with a schema in the mixed "
        f"batch), {sum(r.output_len for r in plain)} output tokens each, {args.max_slots} slots")  # fmt: skip
    modes = args.modes.split(",")
    if "offline" in modes:
        alternate("offline", offline_runner(args, model_dir), plain, mixed, args.rounds)
    if "served" in modes:
        serve_args = argparse.Namespace(
            **vars(args),
            scheduler="continuous",
            tensor_parallel_size=1,
            enable_prefix_caching=False,
            quantization="auto",
            kv_cache_dtype="auto",
            speculative=None,
        )
        server = inflight_system(serve_args, model_dir, kv_blocks_for(plain, args.max_slots))
        try:
            server.start()
            wait_until_ready(f"{server.url}{server.ready_path}", server.process, server.name)
            assert server.process is not None
            alternate("served", served_runner(server.url, server.process.pid), plain, mixed, args.rounds)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
