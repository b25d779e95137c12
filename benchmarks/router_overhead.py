"""What the router adds to time to first token: one real `inflight serve` (tiny model), direct vs through it.

Sequential streaming completions, alternating direct and routed, so both see the same machine load;
reported: TTFT median each way and the difference.

    PYTHONPATH=. .venv/bin/python benchmarks/router_overhead.py [--requests 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "router"))

from router_harness import MODEL, start_router, start_servers, stop_servers  # noqa: E402

from inflight.router.static import static_discovery  # noqa: E402
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
    router = start_router(static_discovery({MODEL: [server.url]}, 5.0))
    direct, routed = [], []
    try:
        with httpx.Client(timeout=60) as client:
            for i in range(args.requests):
                prompt = f"request {i}: def f(x):"
                direct.append(ttft(client, server.url, prompt))
                routed.append(ttft(client, router.url, prompt + " "))
    finally:
        router.stop()
        stop_servers([server])
    d, r = statistics.median(direct) * 1000, statistics.median(routed) * 1000
    print(f"TTFT median: direct {d:.2f} ms, through the router {r:.2f} ms, overhead {r - d:+.2f} ms "
          f"({args.requests} requests each)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
