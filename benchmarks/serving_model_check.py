"""The serving cost model (inflight/sim/serving.py) against `inflight bench serve`, on this CPU.

1. Calibrate, as `inflight demo --calibrate` does (sim/live.py `run_live`, sim/cost_model.py
   `fit_cost_model`): the real engine runs the demo's 30 requests at --slots slots, static then
   continuous, every step timed; seconds per step = fixed + per_token * tokens, by least squares.
2. Predict, with that step cost in serving.py's continuous-batching formula (`policy_estimate`, the code
   `inflight size --workload` and the operator's spec.target use with the roofline step cost): C, the
   requests/s --slots slots serve for bench serve's workload (its mean prompt and mean output). A run of
   N requests sent at the benchmark's Poisson offsets a_1..a_N (the same seed, `arrival_offsets`) cannot
   end before its last request has arrived and been served, nor before C has served all N:

       T = max(a_N + step(P_N, 0) + O_N * step(1, 0), N / C)        predicted requests/s = N / T

3. Measure: `inflight bench serve` at 3 rates (--max-slots --slots, --threads, no offline run), its
   request throughput = completed requests / the run's wall time. The rates default to 0.5, 1 and 2
   times C (below, at and above what the model says the server can do); --rates sets them.

    .venv/bin/python benchmarks/serving_model_check.py [--rates R1,R2,R3] [--num-requests 40] [--slots 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inflight.bench.checkpoint import bench_checkpoint
from inflight.bench.served import arrival_offsets, parse_rates
from inflight.bench.workload import load_workload
from inflight.sim.cost_model import CostModel, fit_cost_model
from inflight.sim.serving import StepCost, Workload, policy_estimate


def calibrate(model_dir: Path, slots: int, threads: int) -> CostModel:
    import torch

    from inflight.engine.config import EngineConfig
    from inflight.sim.live import run_live

    torch.set_num_threads(threads)
    started = time.perf_counter()
    _, samples = run_live(model_dir, slots, EngineConfig(dtype="float32", device="cpu"))
    model = fit_cost_model(samples, source=f"calibrated on {model_dir.name} ({len(samples)} timed steps)")
    print(
        f"calibration: {len(samples)} steps in {time.perf_counter() - started:.0f} s: "
        f"{1000 * model.fixed_s:.2f} ms per step + {1000 * model.per_token_s:.3f} ms per token",
        flush=True,
    )
    return model


def capacity(step: StepCost, slots: int, prompts: list[int], outputs: list[int]) -> float:
    """C: what `slots` slots serve by serving.py's continuous-batching formula, at the mean lengths."""
    workload = Workload(
        prompt_tokens=round(statistics.mean(prompts)), output_tokens=round(statistics.mean(outputs))
    )
    return policy_estimate(step, workload, slots, workload.output_tokens).requests_per_s


def predicted_requests_per_s(
    step: StepCost, served: float, prompts: list[int], outputs: list[int], offsets: list[float]
) -> float:
    """N / T as in the module's docstring, `served` being C."""
    last = offsets[-1] + step(prompts[-1], 0) + outputs[-1] * step(1, 0)
    return len(prompts) / max(last, len(prompts) / served)


def measure(args: argparse.Namespace, out: Path) -> dict[float, float]:
    command = [
        sys.executable, "-m", "inflight.cli", "bench", "serve", "--model", args.model,
        "--request-rate", args.rates, "--num-requests", str(args.num_requests), "--seed", str(args.seed),
        "--max-slots", str(args.slots), "--threads", str(args.threads), "--dtype", "float32",
        "--skip-offline", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    measured = {}
    for rate in parse_rates(args.rates):
        report = json.loads((out / f"serve-poisson-{rate:g}.json").read_text())
        summary = report["systems"]["inflight"]
        if summary["failed"]:
            raise SystemExit(f"{summary['failed']} requests failed at {rate:g} req/s: {summary['errors']}")
        measured[rate] = summary["request_throughput_per_s"]
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--rates", help="Poisson request rates (default: 0.5, 1 and 2 x the model's C)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--slots", type=int, default=8, help="slots of the calibration and the server")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rates and any(rate == float("inf") for rate in parse_rates(args.rates)):
        raise SystemExit("--rates: Poisson rates only (inf has no arrival schedule to predict)")

    model_dir = bench_checkpoint(args.model)  # the checkpoint bench serve serves
    cost = calibrate(model_dir, args.slots, args.threads)

    def step(tokens: int, kv_read: int) -> float:
        return cost.step_seconds(tokens)

    requests = load_workload(model_dir, args.num_requests, args.seed)
    prompts = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.output_len for r in requests]
    served = capacity(step, args.slots, prompts, outputs)
    args.rates = args.rates or ",".join(f"{factor * served:.2g}" for factor in (0.5, 1, 2))
    print(f"model: C = {served:.2f} req/s at {args.slots} slots; rates {args.rates}", flush=True)
    with tempfile.TemporaryDirectory(prefix="serving-model-check-") as work:
        measured = measure(args, Path(work))
    print(
        f"\n{args.model}, float32, {args.slots} slots, {args.threads} thread(s), "
        f"{args.num_requests} requests "
        f"(prompt mean {statistics.mean(prompts):.0f}, output mean {statistics.mean(outputs):.0f} tokens), "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| rate (req/s) | model capacity C | predicted req/s | measured req/s | predicted / measured |")
    print("|---|---|---|---|---|")
    for rate, got in measured.items():
        offsets = arrival_offsets(args.num_requests, rate, args.seed)
        predicted = predicted_requests_per_s(step, served, prompts, outputs, offsets)
        print(f"| {rate:g} | {served:.2f} | {predicted:.2f} | {got:.2f} | {predicted / got:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
