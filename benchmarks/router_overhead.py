"""What the router adds to time to first token: one real `inflight serve` (tiny model), direct vs through it.

The router runs as its own process (`inflight router --upstream`), as deployed. Sequential streaming
completions, alternating direct and routed, so both see the same machine load; reported: TTFT median
each way and the difference.

    PYTHONPATH=. .venv/bin/python benchmarks/router_overhead.py [--requests 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "router"))

from router_harness import MODEL, free_port, start_servers, stop_servers  # noqa: E402

from tests.conftest import cached_model  # noqa: E402


def ttft(client: httpx.Client, url: str, prompt: str) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError("no token streamed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    (server,) = start_servers(
        cached_model("tiny", "llama"), 1, Path(tempfile.mkdtemp(prefix="router-overhead-"))
    )
    port = free_port()
    command = [sys.executable, "-m", "inflight.cli", "router", "--upstream", f"{MODEL}={server.url}"]
    router = subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "warning"], env=os.environ.copy()
    )
    router_url = f"http://127.0.0.1:{port}"
    direct, routed = [], []
    try:
        with httpx.Client(timeout=60) as client:
            while True:
                try:
                    if client.get(f"{router_url}/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            for i in range(args.requests):
                prompt = f"request {i}: def f(x):"
                direct.append(ttft(client, server.url, prompt))
                routed.append(ttft(client, router_url, prompt + " "))
    finally:
        router.terminate()
        router.wait(10)
        stop_servers([server])
    d, r = statistics.median(direct) * 1000, statistics.median(routed) * 1000
    print(f"TTFT median: direct {d:.2f} ms, through the router {r:.2f} ms, overhead {r - d:+.2f} ms "
          f"({args.requests} requests each)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
