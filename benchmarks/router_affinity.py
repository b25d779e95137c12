"""Prefix affinity against round robin: three real `inflight serve` processes (tiny model) behind the router.

The same multi-turn chat workload (conversations whose every turn extends the last) runs once behind
`--policy round-robin` and once behind the prefix policy (different conversations, so neither finds the
other's in the caches). Reported: the replicas' summed prefix-cache hit tokens and TTFT p50.

    PYTHONPATH=. .venv/bin/python benchmarks/router_affinity.py [--conversations 32 --turns 6 --kv-blocks 384]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' shared helpers: `support`

from inflight.router.app import RouterSettings  # noqa: E402
from inflight.router.static import static_discovery  # noqa: E402
from inflight.router.workload import run_conversations  # noqa: E402

from support.models import cached_model  # noqa: E402
from support.router_harness import MODEL, start_router, start_servers, stop_servers  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--kv-blocks", type=int, default=384, help="KV blocks per replica (16 tokens each)")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="router-affinity-"))
    servers = start_servers(cached_model("tiny", "llama"), 3, logs, "--num-kv-blocks", str(args.kv_blocks))
    try:

        def hits() -> float:
            return sum(s.metric("inflight:prefix_cache_hits_total") for s in servers)

        for seed, (name, affinity) in enumerate((("round-robin", False), ("prefix", True)), start=1):
            router = start_router(
                static_discovery({MODEL: [s.url for s in servers]}, 5.0),
                RouterSettings(prefix_affinity=affinity),
            )
            before = hits()
            result = asyncio.run(run_conversations(router.url, MODEL, args.conversations, args.turns, seed))
            router.stop()
            p50_ms = result.ttft_p50 * 1000
            print(f"{name:12s} prefix-cache hit tokens {hits() - before:8.0f}   TTFT p50 {p50_ms:7.1f} ms   "
                  f"({result.requests} requests)", flush=True)  # fmt: skip
    finally:
        stop_servers(servers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
