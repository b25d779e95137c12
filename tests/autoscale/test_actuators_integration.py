"""hpa and keda actuators end to end: the real operator against the emulator creates the HPA or ScaledObject,
and replicas follow what that autoscaler writes through the ModelServer's scale subresource."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from inflight.operator.api.types import ModelServer
from inflight.operator.controller import Controller
from inflight.operator.kube import KubeError

from support.autoscale_harness import running_operator
from support.emulated import DEPLOYMENTS, MODELSERVERS, eventually, kubeconfig_cluster
from support.kube_emulator import KubeEmulator

pytestmark = pytest.mark.timeout(120)

NS = "ns"
MS_URL = f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers"
HPAS = "autoscaling/v2/horizontalpodautoscalers"
SCALED_OBJECTS = "keda.sh/v1alpha1/scaledobjects"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    async with kubeconfig_cluster(tmp_path, monkeypatch) as emulator:
        emulator.declare(HPAS, "HorizontalPodAutoscaler")
        yield emulator


def modelserver(name: str, autoscaling: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "source": "builtin:tiny", "maxModelLen": 512},
            "resources": {"gpu": {"count": 0}, "cpu": "1", "memory": "2Gi"},
            "autoscaling": autoscaling,
        },
    }


def replicas(cluster: KubeEmulator, name: str) -> int | None:
    deployment = cluster.stored(DEPLOYMENTS, NS, name)
    return None if deployment is None else int(deployment["spec"]["replicas"])


def degraded(cluster: KubeEmulator, name: str) -> dict[str, Any]:
    conditions = ((cluster.stored(MODELSERVERS, NS, name) or {}).get("status") or {}).get("conditions") or []
    return next((dict(c) for c in conditions if c["type"] == "Degraded" and c["status"] == "True"), {})


async def test_hpa_actuator_creates_the_hpa_and_replicas_follow_the_scale_subresource(
    cluster: KubeEmulator,
) -> None:
    autoscaling = {"minReplicas": 2, "maxReplicas": 5, "metric": "queueDepth", "target": 3, "actuator": "hpa"}
    async with running_operator():
        created = await (await cluster.post(MS_URL, json=modelserver("llama", autoscaling))).json()
        hpa = await eventually(lambda: cluster.stored(HPAS, NS, "llama"), timeout=60, what="the HPA")
        assert hpa["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "inflight.dev/v1alpha1",
            "kind": "ModelServer",
            "name": "llama",
        }
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "inflight:num_requests_waiting"
        # no spec.replicas yet: minReplicas
        await eventually(lambda: replicas(cluster, "llama") == 2, what="minReplicas on the Deployment")

        # the HPA (here: the test) writes spec.replicas through the scale subresource; the operator carries it
        response = await cluster.patch(
            f"{MS_URL}/llama/scale", data=json.dumps({"spec": {"replicas": 4}}), headers=MERGE
        )
        assert response.status == 200, await response.text()
        await eventually(lambda: replicas(cluster, "llama") == 4, what="the HPA's count on the Deployment")

        # drift on the HPA is repaired
        response = await cluster.patch(
            f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/llama",
            data=json.dumps({"spec": {"maxReplicas": 50}}),
            headers=MERGE,
        )
        assert response.status == 200, await response.text()
        await eventually(
            lambda: (cluster.stored(HPAS, NS, "llama") or {}).get("spec", {}).get("maxReplicas") == 5,
            what="the HPA repaired",
        )
        ms = cluster.stored(MODELSERVERS, NS, "llama") or {}
        assert "autoscaling" not in ms.get("status", {})  # the builtin autoscaler stays out of it
        assert not degraded(cluster, "llama")

        # autoscaling off: the HPA goes (it would be a second writer), spec.replicas rules alone
        response = await cluster.patch(
            f"{MS_URL}/llama", data=json.dumps({"spec": {"autoscaling": None}}), headers=MERGE
        )
        assert response.status == 200, await response.text()
        await eventually(lambda: cluster.stored(HPAS, NS, "llama") is None, what="the HPA deleted")
        assert replicas(cluster, "llama") == 4


class ClusterWithoutKeda:
    """The API calls `_ensure` makes, for a cluster that does not serve keda.sh (a real API server: 404)."""

    async def get(self, path: str) -> None:
        return None

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        raise KubeError(404, "POST", path, "the server could not find the requested resource")


async def test_keda_actuator_without_keda_installed_is_a_problem_that_says_what_to_do() -> None:
    autoscaling = {
        "maxReplicas": 3,
        "target": 4,
        "actuator": "keda",
        "prometheus": {"serverAddress": "http://prometheus.monitoring:9090"},
    }
    body = modelserver("qwen", autoscaling)
    body["metadata"] |= {"namespace": NS, "uid": "uid-qwen"}
    controller = Controller(ClusterWithoutKeda(), lambda *_: None)  # type: ignore[arg-type]
    problem = await controller._ensure_autoscaler(ModelServer.model_validate(body))
    assert problem is not None
    assert problem.reason == "AutoscalerAPIMissing"
    assert "keda.sh/v1alpha1 scaledobjects" in problem.message
    assert "install KEDA or use actuator builtin" in problem.message


async def test_keda_actuator_creates_the_scaled_object(cluster: KubeEmulator) -> None:
    cluster.declare(SCALED_OBJECTS, "ScaledObject")
    autoscaling = {
        "maxReplicas": 3,
        "target": 4,
        "actuator": "keda",
        "prometheus": {"serverAddress": "http://prometheus.monitoring:9090"},
    }
    async with running_operator():
        await cluster.post(MS_URL, json=modelserver("qwen", autoscaling))
        scaled = await eventually(
            lambda: cluster.stored(SCALED_OBJECTS, NS, "qwen"), timeout=60, what="the ScaledObject"
        )
        assert scaled["spec"]["scaleTargetRef"]["kind"] == "ModelServer"
        trigger = scaled["spec"]["triggers"][0]
        assert trigger["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"
        assert trigger["metadata"]["query"].startswith('sum(inflight:num_requests_running{namespace="ns"')
        assert not degraded(cluster, "qwen")
