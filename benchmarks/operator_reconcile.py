"""Operator reconcile latency: time from ModelServer creation to its Deployment being created.

A real kopf operator (`inflight operator`'s `run`, in a thread with its own event loop, as in a process of
its own) reconciles ModelServers in the kmock-based API emulator of tests/operator over real HTTP. Two
runs of N ModelServers each:

- sequential: create one, wait for its Deployment, create the next (the latency of one reconcile);
- burst: create all N at once (the queueing of many reconciles in one operator).

Latency = the emulator's clock at the Deployment's create minus the clock just before the ModelServer's
POST. Writes JSON (all samples, p50/p90/p99) and a PNG (CDF of both runs).

    .venv/bin/python benchmarks/operator_reconcile.py --count 100 --out bench-results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kmock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' shared helpers: `support`

from inflight.operator.main import OperatorOptions, run

from support.emulated import emulated_cluster, write_kubeconfig
from support.kube_emulator import KubeEmulator

URL = "/apis/inflight.dev/v1alpha1/namespaces/bench/modelservers"
DEPLOYMENTS = kmock.resource("apps/v1/deployments")


def model_server(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "source": "builtin:tiny", "maxModelLen": 512},
            "resources": {"gpu": {"count": 0}, "cpu": "1", "memory": "2Gi"},
        },
    }


def deployment_created(cluster: KubeEmulator, name: str) -> float | None:
    return cluster.created_at.get((DEPLOYMENTS, "bench", name))


async def wait_for(cluster: KubeEmulator, names: list[str], timeout: float) -> dict[str, float]:
    deadline = time.perf_counter() + timeout
    found: dict[str, float] = {}
    while len(found) < len(names):
        for name in names:
            if name not in found and (when := deployment_created(cluster, name)) is not None:
                found[name] = when
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(names) - len(found)} Deployments missing after {timeout}s")
        await asyncio.sleep(0.002)
    return found


async def measure(count: int) -> dict[str, list[float]]:
    async with emulated_cluster() as cluster:
        os.environ["KUBECONFIG"] = str(
            write_kubeconfig(Path(tempfile.mkdtemp()) / "kubeconfig", str(cluster.url))
        )
        stop = threading.Event()
        options = OperatorOptions(leader_election=False, liveness=None, resync_seconds=3600)
        thread = threading.Thread(target=lambda: asyncio.run(run(options, stop_flag=stop)), name="operator")
        thread.start()
        try:
            # Warm-up: the first reconcile includes the operator's start and the watches' first listing.
            await cluster.post(URL, json=model_server("warmup"))
            await wait_for(cluster, ["warmup"], 30)

            sequential = []
            for i in range(count):
                name = f"seq-{i}"
                started = time.perf_counter()
                await cluster.post(URL, json=model_server(name))
                sequential.append((await wait_for(cluster, [name], 30))[name] - started)
                print(f"\rsequential {i + 1}/{count}", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)

            names = [f"burst-{i}" for i in range(count)]
            started_at: dict[str, float] = {}

            async def create(name: str) -> None:
                started_at[name] = time.perf_counter()
                await cluster.post(URL, json=model_server(name))

            await asyncio.gather(*(create(name) for name in names))
            found = await wait_for(cluster, names, 120)
            burst = [found[name] - started_at[name] for name in names]
            print(f"burst {count}/{count}", file=sys.stderr)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 30)
    return {"sequential": sequential, "burst": burst}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(samples, 50) * 1000, 2),
        "p90_ms": round(percentile(samples, 90) * 1000, 2),
        "p99_ms": round(percentile(samples, 99) * 1000, 2),
        "mean_ms": round(statistics.fmean(samples) * 1000, 2),
        "max_ms": round(max(samples) * 1000, 2),
    }


def plot(results: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, samples in results.items():
        ordered = sorted(s * 1000 for s in samples)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        stats = summary(samples)
        ax.step(
            ordered,
            fractions,
            where="post",
            label=f"{label}: p50 {stats['p50_ms']} ms, p99 {stats['p99_ms']} ms",
        )
    ax.set_xscale("log")
    ax.set_xlabel("ModelServer created -> Deployment created (ms, log scale)")
    ax.set_ylabel("fraction of ModelServers")
    ax.set_title(
        f"Operator reconcile latency against the kmock emulator ({len(next(iter(results.values())))} each)"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="ModelServers per run")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    results = asyncio.run(measure(args.count))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "operator_reconcile",
        "count": args.count,
        "cpu_count": os.cpu_count(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine inflates latency
        "summary": {label: summary(samples) for label, samples in results.items()},
        "samples_ms": {label: [round(s * 1000, 3) for s in samples] for label, samples in results.items()},
    }
    (args.out / "operator_reconcile.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "operator_reconcile.png")
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {args.out / 'operator_reconcile.json'} and {args.out / 'operator_reconcile.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
