"""/health latency while one large legal answer is built (#27 item 1): `inflight serve` in a subprocess,
one /v1/completions request with echo + logprobs + n on a long prompt, and /health polled back to back
on another connection until the answer has arrived. Reports /health p50 / p99 / max and the answer's
size and time.

    PYTHONPATH=. .venv/bin/python benchmarks/large_answer_health.py [--model builtin:tiny]
        [--prompt-tokens 1024] [--n 48] [--logprobs 20] [--max-tokens 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

from inflight.bench.served import free_port, wait_until_ready


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    port = free_port()
    command = [
        sys.executable, "-m", "inflight.cli", "serve", "--model", args.model, "--served-model-name", "m",
        "--port", str(port), "--max-slots", str(max(args.n, 8)), "--max-model-len", "4096",
        "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(f"{url}/ready", server, "inflight")
        body = {
            "model": "m", "prompt": list(range(10, 10 + args.prompt_tokens)), "echo": True,
            "logprobs": args.logprobs, "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0,
        }  # fmt: skip
        answer: list[tuple[int, int, float]] = []  # status, bytes, seconds

        def request() -> None:
            started = time.perf_counter()
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            answer.append((response.status_code, len(response.content), time.perf_counter() - started))

        thread = threading.Thread(target=request)
        latencies: list[float] = []
        with httpx.Client(timeout=60) as health:
            health.get(f"{url}/health")
            thread.start()
            while thread.is_alive():
                started = time.perf_counter()
                health.get(f"{url}/health")
                latencies.append(time.perf_counter() - started)
        thread.join()
        status, size, seconds = answer[0]
        print(
            f"answer: HTTP {status}, {size / 1e6:.1f} MB in {seconds:.1f} s; "
            f"/health x{len(latencies)}: p50 {statistics.median(latencies) * 1000:.1f} ms, "
            f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
        )
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
