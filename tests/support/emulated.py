"""Shared setup for tests against the emulator: declared resources, a kubeconfig, object helpers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from inflight.operator.main import OperatorOptions, run

from support.kube_emulator import KubeEmulator

MODELSERVERS = "inflight.dev/v1alpha1/modelservers"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
JOBS = "batch/v1/jobs"
PVCS = "v1/persistentvolumeclaims"
PODS = "v1/pods"
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "modelserver.yaml"


@contextlib.asynccontextmanager
async def emulated_cluster() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator() as cluster, kmock.Server(cluster):
        crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        cluster.declare(crds.removeprefix("/apis/"), "CustomResourceDefinition", False)
        cluster.declare(DEPLOYMENTS, "Deployment", subresources=("status", "scale"))
        cluster.declare(SERVICES, "Service")
        cluster.declare("v1/secrets", "Secret")
        cluster.declare(JOBS, "Job", subresources=("status",))
        cluster.declare(PVCS, "PersistentVolumeClaim")
        cluster.declare(PODS, "Pod", subresources=("log",))
        cluster.declare("v1/events", "Event")
        cluster.declare("v1/nodes", "Node", namespaced=False)
        cluster.declare("coordination.k8s.io/v1/leases", "Lease")
        # Every cluster serves these; kopf waits for them in discovery even with scanning disabled.
        cluster.declare("v1/namespaces", "Namespace", namespaced=False)
        # The CRD as `kubectl apply -f crds/modelserver.yaml` sends it: admitted (or refused) as the API
        # server admits it, it serves ModelServers defaulted and validated by its schema.
        applied = await cluster.post(crds, json=yaml.safe_load(CRD_FILE.read_text()))
        assert applied.status == 201, await applied.text()
        yield cluster


@contextlib.asynccontextmanager
async def kubeconfig_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    """An emulated cluster with $KUBECONFIG pointing at it, as the operator and the router find a cluster."""
    async with emulated_cluster() as cluster:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", str(cluster.url))))
        yield cluster


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emulator\n"
        f"clusters: [{{name: emulator, cluster: {{server: '{server}'}}}}]\n"
        "contexts: [{name: emulator, context: {cluster: emulator, user: tester}}]\n"
        "users: [{name: tester, user: {token: test-token}}]\n"
    )
    return path


async def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if result:
            return result
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def posted_events(cluster: KubeEmulator) -> list[dict[str, Any]]:
    """Kubernetes Events stored in the emulator, oldest first."""
    events = [
        obj.raw
        for (resource, _, _), obj in cluster.objects.items()
        if resource.plural == "events" and not obj.deleted
    ]
    return sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"]))


@contextlib.asynccontextmanager
async def running_operator(**options: Any) -> AsyncIterator[None]:
    """The real operator in a thread with an event loop of its own, as kopf's KopfRunner runs it.

    `options` override OperatorOptions (leader election, the liveness and the metrics endpoints are off).
    """
    stop = threading.Event()
    settings = OperatorOptions(leader_election=False, liveness=None, **{"metrics_address": None, **options})
    outcome: list[int | BaseException] = []

    def target() -> None:
        try:
            outcome.append(asyncio.run(run(settings, stop_flag=stop)))
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=target, name="operator")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "the operator did not stop"
        assert outcome == [0], [
            "".join(traceback.format_exception(o)) if isinstance(o, BaseException) else o for o in outcome
        ]
