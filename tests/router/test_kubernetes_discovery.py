"""Discovery from the emulated API server, and scale from zero through the router.

The router (real app, in a thread) watches the emulator. In the first test the test plays the operator
and the kubelet: when the router sets the wake annotation on a ModelServer scaled to zero, it creates a
Ready pod whose IP and `http` port point at a real `inflight serve` process. In the second the real
operator runs (builtin autoscaling, 1 s rounds) and the test plays only the Deployment controller and
the kubelet: a pod per replica, Ready once its server answers /ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inflight.operator.kube import ROUTER_USER_AGENT
from inflight.operator.status import WAKE_ANNOTATION
from inflight.router.app import RouterSettings
from inflight.router.kubernetes import kubernetes_discovery

from support.emulated import (
    DEPLOYMENTS,
    MODELSERVERS,
    eventually,
    kubeconfig_cluster,
    running_operator,
)
from support.kube_emulator import KubeEmulator
from support.router_harness import MODEL, LiveRouter, ServerProcess, start_router, start_servers, stop_servers

pytestmark = pytest.mark.timeout(180)

NS = "ns"
PODS = "v1/pods"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    (started,) = start_servers(tiny_llama_dir, 1, tmp_path_factory.mktemp("server"))
    yield started
    stop_servers([started])


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    async with kubeconfig_cluster(tmp_path, monkeypatch) as emulator:
        yield emulator


def modelserver(name: str, model: str, timeout_s: int, scale_down_delay_s: int = 300) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": model, "source": "builtin:tiny"},
            "resources": {"gpu": {"count": 0}},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "target": 4,
                            "scaleFromZeroTimeoutSeconds": timeout_s,
                            "scaleDownDelaySeconds": scale_down_delay_s},
        },
    }  # fmt: skip


def pod(name: str, owner: str, port: int, ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "inflight-server", "inflight.dev/modelserver": owner},
        },
        "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


async def start_router_on(cluster: KubeEmulator) -> LiveRouter:
    return await asyncio.to_thread(start_router, kubernetes_discovery(NS, 60.0), RouterSettings())


async def test_scale_from_zero_holds_the_request_until_a_replica_is_ready(
    cluster: KubeEmulator, server: ServerProcess
) -> None:
    for body in (modelserver("tiny", MODEL, 60), modelserver("never", "never-ready", 2)):
        response = await cluster.post(f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers", json=body)
        assert response.status in (200, 201), await response.text()
    router = await start_router_on(cluster)
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            models = (await http.get(f"{router.url}/v1/models")).json()["data"]
            assert sorted(m["id"] for m in models) == ["never-ready", MODEL]  # scaled to zero, but wakeable

            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            started = time.monotonic()
            request = asyncio.create_task(http.post(f"{router.url}/v1/completions", json=body))
            woken = await eventually(
                lambda: ((cluster.stored(MODELSERVERS, NS, "tiny") or {}).get("metadata", {})
                         .get("annotations", {}).get(WAKE_ANNOTATION)),
                what="the router's wake request",
            )  # fmt: skip
            assert woken.endswith("Z")
            assert not request.done()
            # The wake annotation is the router's write, and says so in the audit trail.
            wakes = [
                agent for agent, method, path in cluster.audit if method == "PATCH" and path.endswith("/tiny")
            ]
            assert wakes and set(wakes) == {ROUTER_USER_AGENT}, wakes
            # the operator scales up; the pod starts (not ready), then turns Ready
            response = await cluster.post(
                f"/api/v1/namespaces/{NS}/pods", json=pod("tiny-0", "tiny", server.port, False)
            )
            assert response.status in (200, 201)
            await asyncio.sleep(0.3)
            assert not request.done()  # a pod that is not Ready takes no traffic
            ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
            await cluster.patch(f"/api/v1/namespaces/{NS}/pods/tiny-0", data=json.dumps(ready), headers=MERGE)
            answer = await asyncio.wait_for(request, 60)
            hold_s = time.monotonic() - started
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 4
            print(f"first request after idle: held and answered in {hold_s:.2f}s")
            assert router.metric("inflight_router:hold_seconds_count", f'model="{MODEL}"') >= 1

            # draining: deletionTimestamp set -> the pod leaves the pool at once
            draining = {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}
            await cluster.patch(
                f"/api/v1/namespaces/{NS}/pods/tiny-0", data=json.dumps(draining), headers=MERGE
            )
            await eventually(
                lambda: not router.router.pools[MODEL].replicas, what="the draining pod to leave"
            )

            # no replica ever becomes ready: 503 + Retry-After after the spec's timeout
            started = time.monotonic()
            never = await http.post(f"{router.url}/v1/completions", json={**body, "model": "never-ready"})
            assert never.status_code == 503
            assert time.monotonic() - started >= 2.0
            assert never.headers["retry-after"] == "10"
            assert never.json()["error"]["code"] == "no_replica"
            assert (
                router.metric("inflight_router:requests_total", 'model="never-ready",outcome="no_replica"')
                == 1
            )

            # a ModelServer deleted: its model is unknown again
            await cluster.delete(f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers/never")
            await eventually(lambda: "never-ready" not in router.router.pools, what="the model to go")
            gone = await http.post(f"{router.url}/v1/completions", json={**body, "model": "never-ready"})
            assert gone.status_code == 404
    finally:
        await asyncio.to_thread(router.stop)


def replicas(cluster: KubeEmulator, name: str) -> int | None:
    deployment = cluster.stored(DEPLOYMENTS, NS, name)
    return None if deployment is None else int(deployment["spec"]["replicas"])


def is_ready(body: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in body["status"]["conditions"])


async def play_kubelet(cluster: KubeEmulator, name: str, server: ServerProcess) -> None:
    """One pod while the Deployment asks for replicas (pointing at the real server), none at zero."""
    pod_name, url = f"{name}-0", f"/api/v1/namespaces/{NS}/pods"
    async with httpx.AsyncClient() as http:
        while True:
            deployment = cluster.stored(DEPLOYMENTS, NS, name)
            current = cluster.stored(PODS, NS, pod_name)
            wanted = 0 if deployment is None else int(deployment["spec"]["replicas"])
            if wanted > 0 and current is None:
                body = pod(pod_name, name, server.port, ready=False)
                body["metadata"]["labels"] = copy.deepcopy(
                    deployment["spec"]["template"]["metadata"]["labels"]
                )
                await cluster.post(url, json=body)
            elif wanted > 0 and not is_ready(current):
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{server.url}/ready", timeout=1)).status_code == 200:
                        ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
                        await cluster.patch(f"{url}/{pod_name}", data=json.dumps(ready), headers=MERGE)
            elif wanted == 0 and current is not None:
                await cluster.delete(f"{url}/{pod_name}")
            await asyncio.sleep(0.1)


async def test_the_real_operator_wakes_an_idle_modelserver_and_scales_it_back_to_zero(
    cluster: KubeEmulator, server: ServerProcess
) -> None:
    name = "ondemand"
    body = modelserver(name, MODEL, 90, scale_down_delay_s=3)
    kubelet = asyncio.create_task(play_kubelet(cluster, name, server))
    try:
        async with running_operator(autoscale_seconds=1.0, scrape_timeout_seconds=1.0):
            response = await cluster.post(
                f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers", json=body
            )
            assert response.status in (200, 201), await response.text()
            await eventually(lambda: replicas(cluster, name) == 0, what="the Deployment at zero replicas")
            router = await start_router_on(cluster)
            try:
                async with httpx.AsyncClient(timeout=120) as http:
                    request = {"model": MODEL, "prompt": "wake up", "max_tokens": 4}
                    started = time.monotonic()
                    answer = await http.post(f"{router.url}/v1/completions", json=request)
                    hold_s = time.monotonic() - started
                    assert answer.status_code == 200, answer.text
                    print(f"first request after idle (real operator): answered after {hold_s:.2f}s")
                    await eventually(
                        lambda: (cluster.stored(MODELSERVERS, NS, name) or {}).get("status", {})
                        .get("autoscaling", {}).get("desiredReplicas") == 1,
                        what="the autoscaler to record the wake",
                    )  # fmt: skip
                    # idle for the scale-down delay: back to zero, and the router's pool empties
                    await eventually(
                        lambda: replicas(cluster, name) == 0, timeout=60, what="the scale to zero"
                    )
                    await eventually(lambda: not router.router.pools[MODEL].replicas, what="an empty pool")
                    reasons = [
                        obj.raw.get("message", "")
                        for (resource, _, _), obj in cluster.objects.items()
                        if resource.plural == "events" and obj.raw.get("reason") in ("ScaledUp", "ScaledDown")
                    ]
                    assert any("scale from zero" in r for r in reasons), reasons
                    assert any(r.startswith("1 -> 0 replicas") for r in reasons), reasons
            finally:
                await asyncio.to_thread(router.stop)
    finally:
        kubelet.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await kubelet
