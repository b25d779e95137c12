"""The builtin actuator's rounds against an in-memory API and mocked pod servers (fast, no processes)."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import httpx
import pytest

from inflight.operator.api.resources import DEPLOYMENTS, MODELSERVERS
from inflight.operator.api.types import ModelServer
from inflight.operator.builtin_autoscaler import BuiltinAutoscaling
from inflight.operator.controller import Controller
from inflight.operator.metrics import OperatorMetrics
from inflight.operator.status import desired_replicas

NS = "ns"


class MemoryKube:
    """get / list (namespaced or across namespaces, label selectors applied) / status merge-patch."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.created: list[tuple[str, dict[str, Any]]] = []

    async def get(self, path: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get(path))

    async def list(self, path: str, label_selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for key, obj in self.objects.items()
            if path in (key.rsplit("/", 1)[0], re.sub(r"/namespaces/[^/]+", "", key.rsplit("/", 1)[0]))
            and all(obj["metadata"].get("labels", {}).get(k) == v for k, v in (label_selector or {}).items())
        ]

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.created.append((path, copy.deepcopy(dict(body))))
        return dict(body)

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        self.patches.append((path, copy.deepcopy(dict(patch))))
        target = self.objects[path.removesuffix("/status")]
        for key, value in patch["status"].items():
            if value is None:
                target["status"].pop(key, None)
            else:
                target["status"][key] = value
        return copy.deepcopy(target)


class RecordingController:
    """What the loop needs of the Controller: its API client, its metrics and how it finds the pods."""

    server_pods = Controller.server_pods

    def __init__(self, kube: MemoryKube) -> None:
        self.kube = kube
        self.metrics = OperatorMetrics()

    @property
    def events(self) -> list[tuple[str, str, str]]:
        return [
            (e["type"], e["reason"], e["message"])
            for path, e in self.kube.created
            if path.endswith("/events")
        ]


def modelserver(
    name: str, autoscaling: dict[str, Any] | None, status: dict[str, Any] | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": name, "source": "builtin:tiny"}}
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": spec,
        "status": status or {},
    }


def pod(owner: str, index: int, port: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{owner}-{index}",
            "labels": {"app.kubernetes.io/name": "inflight-server", "inflight.dev/modelserver": owner},
        },
        "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


@pytest.fixture
def cluster() -> MemoryKube:
    kube = MemoryKube()
    autoscaling = {"minReplicas": 1, "maxReplicas": 4, "target": 2, "scaleDownDelaySeconds": 0}
    kube.objects[MODELSERVERS.path(NS, "llama")] = modelserver("llama", autoscaling)
    kube.objects[DEPLOYMENTS.path(NS, "llama")] = {"metadata": {"name": "llama"}, "spec": {"replicas": 1}}
    kube.objects[f"/api/v1/namespaces/{NS}/pods/llama-0"] = pod("llama", 0, 8001)
    # another ModelServer's pod in the same namespace is not llama's
    kube.objects[f"/api/v1/namespaces/{NS}/pods/other-0"] = pod("other", 0, 8009)
    return kube


def serving(in_flight: dict[int, int]) -> httpx.AsyncClient:
    def respond(request: httpx.Request) -> httpx.Response:
        running = in_flight[request.url.port or 0]
        return httpx.Response(
            200, text=f"inflight:num_requests_running {running}\ninflight:num_requests_waiting 0\n"
        )

    return httpx.AsyncClient(transport=httpx.MockTransport(respond))


async def test_a_round_records_the_decision_the_reconcile_applies(cluster: MemoryKube) -> None:
    controller = RecordingController(cluster)
    load = {8001: 7, 8009: 100}
    loop = BuiltinAutoscaling(
        controller.kube, controller.metrics, interval_s=1, scrape_timeout_s=1, http=serving(load)
    )  # type: ignore[arg-type]

    await loop.round()
    ms = cluster.objects[MODELSERVERS.path(NS, "llama")]
    assert ms["status"]["autoscaling"]["desiredReplicas"] == 4  # ceil(7 / 2)
    assert ms["status"]["autoscaling"]["currentValue"] == 7
    assert ms["status"]["autoscaling"]["lastScaleTime"]
    # the reconcile (on the status event) sets the Deployment to the one replica-count function's answer
    parsed = ModelServer.model_validate(ms)
    assert desired_replicas(parsed.spec, parsed.status) == 4
    assert [(t, r) for t, r, _ in controller.events] == [("Normal", "ScaledUp")]
    assert controller.events[0][2].startswith("1 -> 4 replicas: load 7 over 1 pod(s)")
    path, event = cluster.created[0]
    assert path == f"/api/v1/namespaces/{NS}/events"
    assert event["involvedObject"] == {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "name": "llama",
        "namespace": NS,
        "uid": "uid-llama",
    }

    await loop.round()
    assert ms["status"]["autoscaling"]["reason"].endswith("fits 4 replicas")
    # an unchanged decision writes nothing and posts nothing
    patches = len(cluster.patches)
    await loop.round()
    assert len(cluster.patches) == patches
    assert len(controller.events) == 1
    registry = controller.metrics.registry
    decisions = [
        registry.get_sample_value("inflight_operator_autoscaling_decisions_total", {"direction": direction})
        for direction in ("up", "down", "hold")
    ]
    assert decisions == [1, 0, 2]


async def test_turning_builtin_autoscaling_off_clears_its_status(cluster: MemoryKube) -> None:
    controller = RecordingController(cluster)
    loop = BuiltinAutoscaling(
        controller.kube, controller.metrics, interval_s=1, scrape_timeout_s=1, http=serving({8001: 1})
    )  # type: ignore[arg-type]
    await loop.round()
    assert ("ns", "llama") in loop.states

    ms = cluster.objects[MODELSERVERS.path(NS, "llama")]
    ms["spec"]["autoscaling"]["actuator"] = "hpa"
    await loop.round()
    assert "autoscaling" not in ms["status"]
    assert loop.states == {}


async def test_no_deployment_yet_is_not_an_error(cluster: MemoryKube) -> None:
    del cluster.objects[DEPLOYMENTS.path(NS, "llama")]
    controller = RecordingController(cluster)
    loop = BuiltinAutoscaling(
        controller.kube, controller.metrics, interval_s=1, scrape_timeout_s=1, http=serving({8001: 9})
    )  # type: ignore[arg-type]
    await loop.round()
    assert cluster.patches == []
    assert controller.events == []
