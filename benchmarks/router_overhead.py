"""What the router adds to time to first token: one real `inflight serve` (tiny model), direct vs through it.

The router runs as its own process (`inflight router --upstream`), as deployed. Sequential streaming
completions, alternating direct and routed, so both see the same machine load; reported per round: TTFT
median each way, the difference, and the router's CPU time per request (which machine load does not
inflate); then the median of the rounds' differences.

    PYTHONPATH=. .venv/bin/python benchmarks/router_overhead.py [--requests 200] [--rounds 5] [--profile F]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' shared helpers: `support`

from support.models import cached_model  # noqa: E402
from support.router_harness import MODEL, free_port, start_servers, stop_servers  # noqa: E402


def ttft(client: httpx.Client, url: str, prompt: str) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter() - started
    # read to the end, as a client does: a stream left early closes the connections (both hops)
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def router_cpu_s(router: subprocess.Popen[bytes]) -> float:
    """CPU seconds the router process has used so far (under --profile: py-spy's child)."""
    process = psutil.Process(router.pid)
    if process.name().startswith("py-spy"):
        process = process.children()[0]
    times = process.cpu_times()
    return float(times.user + times.system)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests each way per round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (one server and router for all)")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="run the router under py-spy and write its samples there (collapsed stacks, for flame graphs)",
    )
    args = parser.parse_args()
    (server,) = start_servers(
        cached_model("tiny", "llama"), 1, Path(tempfile.mkdtemp(prefix="router-overhead-"))
    )
    port = free_port()
    command = [sys.executable, "-m", "inflight.cli", "router", "--upstream", f"{MODEL}={server.url}"]
    if args.profile:
        py_spy = str(Path(sys.executable).with_name("py-spy"))
        command = [py_spy, "record", "--format", "raw", "--rate", "1000", "-o", args.profile, "--", *command]
    router = subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "warning"], env=os.environ.copy()
    )
    router_url = f"http://127.0.0.1:{port}"
    overheads = []
    try:
        with httpx.Client(timeout=60) as client:
            while True:
                try:
                    if client.get(f"{router_url}/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            for _ in range(10):  # warm-up: connections opened, code paths run once
                ttft(client, router_url, "warm-up")
            for round_ in range(1, args.rounds + 1):
                direct, routed = [], []
                cpu_before = router_cpu_s(router)
                for i in range(args.requests):
                    prompt = f"round {round_} request {i}: def f(x):"
                    # alternate which goes first, so neither always finds the server just woken
                    if i % 2:
                        direct.append(ttft(client, server.url, prompt))
                        routed.append(ttft(client, router_url, prompt + " "))
                    else:
                        routed.append(ttft(client, router_url, prompt + " "))
                        direct.append(ttft(client, server.url, prompt))
                cpu_ms = (router_cpu_s(router) - cpu_before) / args.requests * 1000
                d, r = statistics.median(direct) * 1000, statistics.median(routed) * 1000
                overheads.append(r - d)
                print(f"round {round_}: TTFT median direct {d:.2f} ms, through the router {r:.2f} ms, "
                      f"overhead {r - d:+.2f} ms; router CPU {cpu_ms:.2f} ms per request "
                      f"({args.requests} requests each way; load average {os.getloadavg()[0]:.1f})",
                      flush=True)  # fmt: skip
    finally:
        router.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
        router.wait(30)
        stop_servers([server])
    print(f"overhead, median of {args.rounds} round medians: {statistics.median(overheads):+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
