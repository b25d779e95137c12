"""Measured sizing end to end: real `inflight serve` processes are the pods, started with the Deployment's own
arguments, and the real operator (against the emulator) reads what they run with from their /metrics.

Replica 0 runs exactly the planned KV pool: `status.sizing.measured` equals the plan and there is no
SizingDrift condition. Replica 1 runs with half the planned blocks (as a server that found less free
memory than planned would): SizingDrift turns True with both numbers in its message, a Warning Event is
posted, and the operator's own /metrics reports the drift.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.autoscale_harness import (
    MERGE,
    background,
    mark_ready,
    pod_from_template,
    ready,
    report_deployment_status,
    server_ready,
)
from support.emulated import (
    DEPLOYMENTS,
    MODELSERVERS,
    eventually,
    kubeconfig_cluster,
    posted_events,
    running_operator,
)
from support.kube_emulator import KubeEmulator
from support.processes import free_port, stop_processes

pytestmark = pytest.mark.timeout(150)

NS = "ns"
NAME = "tiny"
PODS = "v1/pods"
POD_URL = f"/api/v1/namespaces/{NS}/pods"
MS_URL = f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers"
MODELSERVER = {
    "apiVersion": "inflight.dev/v1alpha1",
    "kind": "ModelServer",
    "metadata": {"name": NAME},
    "spec": {
        "replicas": 1,
        "model": {"name": NAME, "source": "builtin:tiny", "maxModelLen": 256},
        # 0.9 x 1280 MiB less the 1 GiB activation reserve: a KV pool of ~130 MB per replica
        "resources": {"gpu": {"count": 0}, "cpu": "1", "memory": "1280Mi"},
    },
}


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    async with kubeconfig_cluster(tmp_path, monkeypatch) as emulator:
        yield emulator


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_processes(started)


def server_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    return dict(container)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def with_flag(args: list[str], name: str, value: str) -> list[str]:
    changed = list(args)
    changed[changed.index(name) + 1] = value
    return changed


def start_server(
    deployment: dict[str, Any], model_dir: Path, port: int, kv_blocks: int, log: Path
) -> subprocess.Popen[bytes]:
    """The pod's server as the Deployment runs it, with the model from disk, on loopback at `port`."""
    args = server_container(deployment)["args"]
    for name, value in (
        ("--model", str(model_dir)),
        ("--host", "127.0.0.1"),
        ("--port", str(port)),
        ("--num-kv-blocks", str(kv_blocks)),
    ):
        args = with_flag(args, name, value)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "inflight.cli", "serve", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def live_pods(cluster: KubeEmulator) -> dict[str, dict[str, Any]]:
    resource = kmock.resource(PODS)
    return {key[2]: obj.raw for key, obj in cluster.objects.items() if key[0] == resource and not obj.deleted}


async def play_kubelet(cluster: KubeEmulator, ports: list[int]) -> None:
    """Pods follow spec.replicas (pod i is server i) and turn Ready with their server; counts follow."""
    reported: dict[str, int] = {}
    async with httpx.AsyncClient() as http:
        while True:
            deployment = cluster.stored(DEPLOYMENTS, NS, NAME)
            assert deployment is not None
            live = live_pods(cluster)
            for index in range(min(int(deployment["spec"]["replicas"]), len(ports))):
                name = f"{NAME}-{index}"
                if name not in live:
                    response = await cluster.post(
                        POD_URL, json=pod_from_template(deployment, name, ports[index])
                    )
                    assert response.status in (200, 201), await response.text()
                elif not ready(live[name]) and await server_ready(http, ports[index]):
                    await mark_ready(cluster, f"{POD_URL}/{name}")
            reported = await report_deployment_status(cluster, deployment, live_pods(cluster), reported)
            await asyncio.sleep(0.2)


def status(cluster: KubeEmulator) -> dict[str, Any]:
    return dict((cluster.stored(MODELSERVERS, NS, NAME) or {}).get("status") or {})


def condition(cluster: KubeEmulator, kind: str) -> dict[str, Any] | None:
    return next((c for c in status(cluster).get("conditions") or [] if c["type"] == kind), None)


def operator_samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_measured_sizing_matches_the_plan_and_a_short_replica_is_sizing_drift(
    cluster: KubeEmulator, tiny_llama_dir: Path, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    metrics_port = free_port()
    async with running_operator(metrics_address=f"127.0.0.1:{metrics_port}", scrape_timeout_seconds=5.0):
        response = await cluster.post(MS_URL, json=MODELSERVER)
        assert response.status in (200, 201), await response.text()
        deployment = await eventually(
            lambda: cluster.stored(DEPLOYMENTS, NS, NAME), timeout=60, what="the Deployment"
        )
        args = server_container(deployment)["args"]
        planned = await eventually(
            lambda: status(cluster).get("sizing"), timeout=60, what="the planned sizing in status"
        )
        assert int(flag(args, "--num-kv-blocks")) == planned["kvBlocks"] > 100
        ports = [free_port(), free_port()]
        short = planned["kvBlocks"] // 2  # replica 1 finds memory for only half the plan
        for index, blocks in enumerate((planned["kvBlocks"], short)):
            log = tmp_path / f"server-{index}.log"
            processes.append(start_server(deployment, tiny_llama_dir, ports[index], blocks, log))

        async with background(play_kubelet(cluster, ports)):
            measured = await eventually(
                lambda: status(cluster).get("sizing", {}).get("measured"),
                timeout=100,
                what="replica 0 measured",
            )
            assert measured == {
                "replicas": 1,
                "kvBlocksMin": planned["kvBlocks"],
                "kvBlocksMax": planned["kvBlocks"],
                "kvBlocksRatio": 1.0,
                "slotsMin": planned["slots"],
                "slotsMax": planned["slots"],
                "dtype": planned["dtype"],
                "tensorParallel": 1,
                "kvCacheDtype": planned["kvCacheDtype"],
            }
            assert condition(cluster, "SizingDrift") is None
            assert not [e for e in posted_events(cluster) if e["reason"] == "SizingDrift"]

            patch = json.dumps({"spec": {"replicas": 2}})
            await cluster.patch(f"{MS_URL}/{NAME}", data=patch, headers=MERGE)
            drift = await eventually(
                lambda: condition(cluster, "SizingDrift"), timeout=100, what="the SizingDrift condition"
            )
            assert drift["status"] == "True" and drift["reason"] == "FewerKVBlocksThanPlanned"
            assert f"pod {NAME}-1 runs with {short} KV blocks" in drift["message"]
            assert f"the plan has {planned['kvBlocks']}" in drift["message"]
            assert status(cluster)["sizing"]["measured"] == {
                **measured,
                "replicas": 2,
                "kvBlocksMin": short,
                "kvBlocksRatio": round(short / planned["kvBlocks"], 3),
            }
            events = await eventually(
                lambda: [e for e in posted_events(cluster) if e["reason"] == "SizingDrift"],
                timeout=60,
                what="the SizingDrift Event",
            )
            assert events[0]["type"] == "Warning" and events[0]["message"] == drift["message"]

            samples = operator_samples(metrics_port)
            ms_labels = (("modelserver", NAME), ("namespace", NS))
            assert (
                samples[("inflight_operator_modelserver_kv_blocks_planned", ms_labels)] == planned["kvBlocks"]
            )
            assert samples[("inflight_operator_modelserver_kv_blocks_measured_min", ms_labels)] == short
            drifting = (("condition", "SizingDrift"), ("status", "True"))
            assert samples[("inflight_operator_modelservers", drifting)] == 1
            assert samples[("inflight_operator_reconciles_total", (("result", "ok"),))] >= 3
