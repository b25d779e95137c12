"""Builtin autoscaling end to end: real `inflight serve` processes are the pods, the real kopf operator runs
against the emulator, concurrent requests raise the Deployment's replicas, and quiet lowers them again.

The test plays the Deployment controller and the kubelet: for replica i it creates the Pod `tiny-i` from
the Deployment's template with podIP 127.0.0.1 and the server container's `http` port set to server i's
port (the operator finds a pod's server the same way in a cluster: pod IP + the container port named
`http`), marks it Ready once its server answers `/ready`, and keeps the Deployment's status counts current.
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest

from support.autoscale_harness import (
    background,
    mark_ready,
    pod_from_template,
    ready,
    report_deployment_status,
    running_operator,
    server_ready,
)
from support.emulated import DEPLOYMENTS, MODELSERVERS, eventually, kubeconfig_cluster
from support.kube_emulator import KubeEmulator
from support.processes import free_port, stop_processes

pytestmark = pytest.mark.timeout(150)

NS = "ns"
NAME = "tiny"
SERVERS = 2  # the pods; 2 cores run them, the operator and the load
PODS = "v1/pods"
POD_URL = f"/api/v1/namespaces/{NS}/pods"
POD_STARTUP_S = 1.0  # how long a new "pod" takes to become Ready
SCALE_DOWN_DELAY_S = 5
CLIENTS = 6  # concurrent request loops


@dataclass
class Servers:
    ports: list[int]
    processes: list[subprocess.Popen[bytes]]
    logs: Path

    def check_alive(self) -> None:
        for port, process in zip(self.ports, self.processes, strict=True):
            if process.poll() is not None:
                log = (self.logs / f"server-{port}.log").read_text()
                raise AssertionError(f"server on port {port} exited ({process.returncode}):\n{log[-3000:]}")


@pytest.fixture
def servers(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Servers]:
    """Real servers of the tiny model, started at once; a pod turns Ready when its server's /ready does."""
    ports = [free_port() for _ in range(SERVERS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            command = [sys.executable, "-m", "inflight.cli", "serve", "--model", str(tiny_llama_dir)]
            command += ["--served-model-name", NAME, "--port", str(port), "--max-slots", "4"]
            with open(tmp_path / f"server-{port}.log", "wb") as log:
                processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        yield Servers(ports, processes, tmp_path)
    finally:
        stop_processes(processes)


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    async with kubeconfig_cluster(tmp_path, monkeypatch) as emulator:
        yield emulator


def pods(cluster: KubeEmulator) -> dict[str, dict[str, Any]]:
    resource = kmock.resource(PODS)
    return {
        key[2]: copy.deepcopy(obj.raw)
        for key, obj in cluster.objects.items()
        if key[0] == resource and key[1] == NS and not obj.deleted
    }


def served_port(pod: dict[str, Any]) -> int:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "server"]
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    return int(port)


async def play_controllers(cluster: KubeEmulator, servers: Servers) -> None:
    """The Deployment controller and kubelet: pods follow spec.replicas (pod i runs on server i), a pod is
    Ready once POD_STARTUP_S passed and its server answers /ready, status counts follow the pods."""
    born: dict[str, float] = {}
    reported: dict[str, int] = {}
    async with httpx.AsyncClient() as http:
        while True:
            servers.check_alive()
            deployment = cluster.stored(DEPLOYMENTS, NS, NAME)
            if deployment is not None:
                wanted = min(int(deployment["spec"]["replicas"]), len(servers.ports))
                live = pods(cluster)
                for index in range(wanted):
                    name, port = f"{NAME}-{index}", servers.ports[index]
                    if name not in live:
                        response = await cluster.post(POD_URL, json=pod_from_template(deployment, name, port))
                        assert response.status in (200, 201), await response.text()
                        born[name] = time.monotonic()
                    elif (
                        not ready(live[name])
                        and time.monotonic() - born.get(name, 0.0) >= POD_STARTUP_S
                        and await server_ready(http, port)
                    ):
                        await mark_ready(cluster, f"{POD_URL}/{name}")
                for name in live:
                    if int(name.rsplit("-", 1)[1]) >= wanted:
                        await cluster.delete(f"{POD_URL}/{name}")
                reported = await report_deployment_status(cluster, deployment, pods(cluster), reported)
            await asyncio.sleep(0.2)


async def send_load(cluster: KubeEmulator, clients: int) -> None:
    """`clients` loops, each sending one completion after another to the ready pods (as a Service would)."""
    async with httpx.AsyncClient(timeout=60) as http:

        async def client(k: int) -> None:
            while True:
                ports = sorted(served_port(p) for p in pods(cluster).values() if ready(p))
                if not ports:
                    await asyncio.sleep(0.1)
                    continue
                body = {"model": NAME, "prompt": "the quick brown fox", "max_tokens": 512, "ignore_eos": True}
                response = await http.post(
                    f"http://127.0.0.1:{ports[k % len(ports)]}/v1/completions", json=body
                )
                assert response.status_code == 200, response.text

        await asyncio.gather(*(client(k) for k in range(clients)))


def replicas(cluster: KubeEmulator) -> int | None:
    deployment = cluster.stored(DEPLOYMENTS, NS, NAME)
    return None if deployment is None else int(deployment["spec"]["replicas"])


def autoscaling_status(cluster: KubeEmulator) -> dict[str, Any]:
    ms = cluster.stored(MODELSERVERS, NS, NAME) or {}
    return dict(ms.get("status", {}).get("autoscaling") or {})


def scaling_events(cluster: KubeEmulator) -> list[tuple[str, str]]:
    """(reason, message) of the autoscaler's Events, oldest first."""
    resource = kmock.resource("v1/events")
    found = [
        obj.raw
        for key, obj in cluster.objects.items()
        if key[0] == resource and not obj.deleted and obj.raw.get("reason") in ("ScaledUp", "ScaledDown")
    ]
    found.sort(key=lambda event: int(event["metadata"]["resourceVersion"]))
    return [(event["reason"], event["message"]) for event in found]


async def test_load_raises_replicas_and_quiet_lowers_them(cluster: KubeEmulator, servers: Servers) -> None:
    modelserver = {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": NAME, "source": "builtin:tiny", "maxModelLen": 512},
            "resources": {"gpu": {"count": 0}, "cpu": "1", "memory": "2Gi"},
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": SERVERS,
                "metric": "requestsInFlight",
                "target": 2,
                "scaleDownDelaySeconds": SCALE_DOWN_DELAY_S,
            },
        },
    }
    async with running_operator(), background(play_controllers(cluster, servers)):
        response = await cluster.post(
            f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers", json=modelserver
        )
        assert response.status in (200, 201), await response.text()
        await eventually(lambda: replicas(cluster) == 1, timeout=60, what="the Deployment with 1 replica")
        # the servers load the model meanwhile (slow on a busy 2-core machine)
        await eventually(
            lambda: any(ready(p) for p in pods(cluster).values()), timeout=100, what="pod 0 ready"
        )
        await eventually(lambda: autoscaling_status(cluster).get("currentValue") == 0, what="an idle round")
        assert replicas(cluster) == 1
        assert autoscaling_status(cluster)["desiredReplicas"] == 1

        async with background(send_load(cluster, CLIENTS)):
            # ~6 requests in flight at target 2 ask for 3 replicas: capped at maxReplicas
            await eventually(lambda: replicas(cluster) == SERVERS, timeout=30, what="the scale-up")
            status = autoscaling_status(cluster)
            assert status["desiredReplicas"] == SERVERS
            scaled_up_at = status["lastScaleTime"]
            await eventually(
                lambda: sum(ready(p) for p in pods(cluster).values()) == SERVERS,
                timeout=60,
                what="all pods ready",
            )
            await asyncio.sleep(3)  # the load is spread over the replicas now: they stay
            assert replicas(cluster) == SERVERS
            load_stopped = time.monotonic()

        await asyncio.sleep(1.5)  # quiet rounds now, but not for the whole delay yet
        assert replicas(cluster) == SERVERS
        await eventually(lambda: replicas(cluster) == 1, timeout=30, what="the scale-down")
        assert time.monotonic() - load_stopped >= SCALE_DOWN_DELAY_S - 2.0  # rounds are ~1 s apart
        status = autoscaling_status(cluster)
        assert status["desiredReplicas"] == 1
        assert status["lastScaleTime"] >= scaled_up_at

        scaling = await eventually(
            lambda: (e := scaling_events(cluster)) and e[-1][0] == "ScaledDown" and e,
            timeout=60,
            what="the scaling Events",
        )
        assert [reason for reason, _ in scaling] == ["ScaledUp", "ScaledDown"], scaling
        assert scaling[0][1].startswith(f"1 -> {SERVERS} replicas")
        assert scaling[1][1].startswith(f"{SERVERS} -> 1 replicas")
        assert f"for {SCALE_DOWN_DELAY_S}s" in scaling[1][1]
