"""The real operator for the integration tests (short autoscaling rounds) and helpers to play pods."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from support.emulated import running_operator as _running_operator
from support.kube_emulator import KubeEmulator

MERGE = {"Content-Type": "application/merge-patch+json"}


def running_operator(autoscale_seconds: float = 1.0) -> contextlib.AbstractAsyncContextManager[Any]:
    return _running_operator(autoscale_seconds=autoscale_seconds, scrape_timeout_seconds=1.0)


@contextlib.asynccontextmanager
async def background(coroutine: Any) -> AsyncIterator[None]:
    task = asyncio.create_task(coroutine)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])


async def server_ready(http: httpx.AsyncClient, port: int) -> bool:
    """The readiness probe: GET /ready on the pod's server port."""
    with contextlib.suppress(httpx.HTTPError):
        return (await http.get(f"http://127.0.0.1:{port}/ready", timeout=1)).status_code == 200
    return False


async def mark_ready(cluster: KubeEmulator, pod_url: str) -> None:
    """The kubelet's part once the pod's readiness probe passes: the pod's Ready condition."""
    status = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    await cluster.patch(pod_url, data=json.dumps(status), headers=MERGE)


async def report_deployment_status(
    cluster: KubeEmulator,
    deployment: dict[str, Any],
    pods: dict[str, dict[str, Any]],
    reported: dict[str, int],
) -> dict[str, int]:
    """The Deployment controller's part: status counts from the live `pods`, patched when they differ from
    what was `reported` last; returns what is reported now."""
    ready_count = sum(1 for pod in pods.values() if ready(pod))
    counts = {
        "observedGeneration": deployment["metadata"]["generation"],
        "replicas": len(pods),
        "updatedReplicas": len(pods),
        "readyReplicas": ready_count,
        "availableReplicas": ready_count,
    }
    if counts != reported:
        meta = deployment["metadata"]
        url = f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{meta['name']}/status"
        await cluster.patch(url, data=json.dumps({"status": counts}), headers=MERGE)
    return counts


def pod_from_template(deployment: dict[str, Any], name: str, port: int) -> dict[str, Any]:
    """Pod `name` as the Deployment controller makes it from the template (its labels and annotations),
    running on this host and not Ready yet; its server container serves on `port`."""
    template = copy.deepcopy(deployment["spec"]["template"])
    for container in template["spec"]["containers"]:
        if container["name"] == "server":
            container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **template["metadata"]},
        "spec": template["spec"],
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "False"}],
        },
    }
