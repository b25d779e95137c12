"""A bounded soak of `inflight serve` on loopback (#27 item 7): concurrent clients send completions and chat
requests, streamed and not, and cut a share of the streams at a random point; the server's RSS is sampled
every minute. At the end: the status codes seen (5xx must be 0), the KV cache usage once idle (must be 0),
and whether RSS was flat over the last 10 minutes (within 2 %).

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py [--model builtin:smollm2] [--minutes 30]
        [--concurrency 24] [--disconnect 0.2] [--out bench-results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from inflight.bench.served import free_port, wait_until_ready

WORDS = ("the", "a", "model", "server", "request", "token", "batch", "memory", "cache", "slot", "why", "how")


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def client(
    http: httpx.AsyncClient,
    url: str,
    deadline: float,
    disconnect: float,
    seed: int,
    codes: collections.Counter[str],
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200)))
        stream = rng.random() < 0.6
        chat = rng.random() < 0.5
        body: dict[str, object] = {"model": "m", "max_tokens": rng.randint(8, 128), "temperature": 0.8}
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        body["stream"] = stream
        cut = stream and rng.random() < disconnect
        try:
            if stream:
                async with http.stream("POST", url + path, json=body) as response:
                    codes[str(response.status_code)] += 1
                    chunks, stop_after = 0, rng.randint(1, 20)
                    async for _ in response.aiter_lines():
                        chunks += 1
                        if cut and chunks >= stop_after:
                            codes["cut"] += 1
                            break
            else:
                response = await http.post(url + path, json=body)
                codes[str(response.status_code)] += 1
        except httpx.HTTPError as error:
            codes[f"error:{type(error).__name__}"] += 1


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    codes: collections.Counter[str] = collections.Counter()
    process = psutil.Process(pid)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    samples: list[tuple[float, float]] = [(0.0, process.memory_info().rss / 2**20)]
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        workers = [
            asyncio.create_task(client(http, url, deadline, args.disconnect, seed, codes))
            for seed in range(args.concurrency)
        ]
        while time.monotonic() < deadline:
            await asyncio.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
            minute = (time.monotonic() - started) / 60
            samples.append((round(minute, 2), process.memory_info().rss / 2**20))
            print(f"{minute:5.1f} min  RSS {samples[-1][1]:8.1f} MiB  {dict(codes)}", flush=True)
        await asyncio.gather(*workers)
        for _ in range(120):  # the engine finishes or frees what the cut streams left
            text = (await http.get(url + "/metrics")).text
            if metric(text, "inflight:num_requests_running") == 0:
                break
            await asyncio.sleep(1)
        kv = metric(text, "inflight:kv_cache_usage_perc")
    last = [rss for minute, rss in samples if minute >= args.minutes - 10]
    spread = (max(last) - min(last)) / min(last) if last else 0.0
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "rss_mib_per_minute": samples,
        "last_10_minutes_spread": spread,
        "status_codes": dict(codes),
        "server_errors": sum(n for code, n in codes.items() if code.startswith("5")),
        "kv_cache_usage_after": kv,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument(
        "--disconnect", type=float, default=0.2, help="share of streams cut at a random point"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/soak.json"))
    args = parser.parse_args()
    port = free_port()
    command = [
        sys.executable, "-m", "inflight.cli", "serve", "--model", args.model, "--served-model-name", "m",
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(command, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(f"{url}/ready", server, "inflight")
        result = asyncio.run(soak(url, server.pid, args))
    finally:
        server.terminate()
        server.wait(120)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib_per_minute"}))


if __name__ == "__main__":
    main()
