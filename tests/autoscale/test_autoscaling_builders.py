"""HPA and KEDA ScaledObject builders, validated against Kubernetes 1.32 and KEDA's published CRD."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from inflight.operator.api.types import AutoscalingMetric, ModelServer
from inflight.operator.autoscaling.decision import ScalingPolicy
from inflight.operator.children.autoscalers import (
    autoscaler_object,
    build_hpa,
    build_scaled_object,
    prometheus_query,
    quantity,
)

KEDA_CRD = Path(__file__).parent / "data" / "keda" / "keda.sh_scaledobjects.yaml"
OWNER = {
    "apiVersion": "inflight.dev/v1alpha1",
    "kind": "ModelServer",
    "name": "llama",
    "uid": "0b6f3a53-1b7e-4a55-9d4c-2d1f1c0e9a11",
    "controller": True,
    "blockOwnerDeletion": True,
}
LABELS = {"app.kubernetes.io/name": "inflight", "app.kubernetes.io/instance": "llama"}
POLICY = ScalingPolicy(
    min_replicas=1, max_replicas=8, target=0.8, scale_up_stabilization_s=0, scale_down_delay_s=300
)


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields rejected, as the API server would prune (silently drop) them."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


@pytest.fixture(scope="module")
def scaled_object_schema() -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return closed(schema)


@pytest.mark.parametrize("metric", list(AutoscalingMetric))
def test_hpa_is_valid_for_kubernetes_1_32(metric: AutoscalingMetric) -> None:
    hpa = build_hpa("llama", "serving", POLICY, metric, OWNER, LABELS)
    kubernetes_validate.validate(hpa, "1.32.0", strict=True)


def test_hpa_targets_the_modelserver_scale_subresource_with_a_pods_metric() -> None:
    hpa = build_hpa("llama", "serving", POLICY, AutoscalingMetric.KV_CACHE_USAGE, OWNER, LABELS)
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "name": "llama",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 8)
    assert spec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "inflight:kv_cache_usage_perc"},
                "target": {"type": "AverageValue", "averageValue": "800m"},
            },
        }
    ]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert hpa["metadata"]["ownerReferences"] == [OWNER]


def test_hpa_metric_name_can_be_overridden() -> None:
    hpa = build_hpa(
        "llama", "serving", POLICY, AutoscalingMetric.QUEUE_DEPTH, OWNER, LABELS, metric_name="queue"
    )
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "queue"


@pytest.mark.parametrize(
    ("value", "text"), [(4, "4"), (4.0, "4"), (0.8, "800m"), (2.5, "2500m"), (0.001, "1m")]
)
def test_quantity(value: float, text: str) -> None:
    assert quantity(value) == text


def test_quantity_rejects_what_kubernetes_cannot_hold() -> None:
    with pytest.raises(ValueError, match="finer than a thousandth"):
        quantity(0.0005)


@pytest.mark.parametrize("metric", list(AutoscalingMetric))
def test_scaled_object_is_valid_for_kedas_crd(
    metric: AutoscalingMetric, scaled_object_schema: dict[str, Any]
) -> None:
    scaled = build_scaled_object("llama", "serving", POLICY, metric, OWNER, LABELS, "http://prometheus:9090")
    jsonschema.validate(scaled, scaled_object_schema)


def test_closed_schema_catches_a_misspelt_field(scaled_object_schema: dict[str, Any]) -> None:
    scaled = build_scaled_object(
        "llama", "serving", POLICY, AutoscalingMetric.QUEUE_DEPTH, OWNER, LABELS, "http://prometheus:9090"
    )
    scaled["spec"]["minReplicas"] = 1  # KEDA calls it minReplicaCount; the API server would drop this
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(scaled, scaled_object_schema)


def test_scaled_object_has_a_prometheus_trigger_with_the_built_query() -> None:
    scaled = build_scaled_object(
        "llama", "serving", POLICY, AutoscalingMetric.REQUESTS_IN_FLIGHT, OWNER, LABELS, "http://prom:9090"
    )
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["kind"] == "ModelServer"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 8)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": "http://prom:9090",
        "query": 'sum(inflight:num_requests_running{namespace="serving",pod=~"llama-[a-z0-9]+-[a-z0-9]+"})'
        ' + sum(inflight:num_requests_waiting{namespace="serving",pod=~"llama-[a-z0-9]+-[a-z0-9]+"})',
        "threshold": "0.8",
    }
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down == {"stabilizationWindowSeconds": 300}


def test_scaled_object_takes_the_query_from_the_spec() -> None:
    scaled = build_scaled_object(
        "llama",
        "serving",
        POLICY,
        AutoscalingMetric.QUEUE_DEPTH,
        OWNER,
        LABELS,
        "http://prom:9090",
        query="vector(3)",
    )
    assert scaled["spec"]["triggers"][0]["metadata"]["query"] == "vector(3)"


def test_scaled_object_needs_a_prometheus_address() -> None:
    with pytest.raises(ValueError, match=r"spec\.autoscaling\.prometheus\.serverAddress"):
        build_scaled_object("llama", "serving", POLICY, AutoscalingMetric.QUEUE_DEPTH, OWNER, LABELS, "")


def test_query_for_a_single_series_metric() -> None:
    assert prometheus_query(AutoscalingMetric.KV_CACHE_USAGE, "ns", "m") == (
        'sum(inflight:kv_cache_usage_perc{namespace="ns",pod=~"m-[a-z0-9]+-[a-z0-9]+"})'
    )


def test_a_scale_down_delay_beyond_the_hpas_limit_is_an_error() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, target=1, scale_down_delay_s=7200)
    with pytest.raises(ValueError, match="at most 3600s; lower it, or use actuator builtin"):
        build_hpa("llama", "serving", policy, AutoscalingMetric.QUEUE_DEPTH, OWNER, LABELS)


def modelserver(**autoscaling: Any) -> ModelServer:
    return ModelServer.model_validate(
        {
            "apiVersion": "inflight.dev/v1alpha1",
            "kind": "ModelServer",
            "metadata": {"name": "llama", "namespace": "serving", "uid": OWNER["uid"]},
            "spec": {
                "model": {"name": "llama", "source": "builtin:tiny"},
                "autoscaling": {"maxReplicas": 4, "target": 8, **autoscaling},
            },
        }
    )


def test_autoscaler_object_follows_the_actuator(scaled_object_schema: dict[str, Any]) -> None:
    assert autoscaler_object(modelserver()) is None  # builtin: the operator scales, no HPA
    hpa = autoscaler_object(modelserver(actuator="hpa", metric="queueDepth"))
    assert hpa is not None and hpa["kind"] == "HorizontalPodAutoscaler"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == OWNER["uid"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "inflight:num_requests_waiting"
    kubernetes_validate.validate(hpa, "1.32.0", strict=True)

    prometheus = {"serverAddress": "http://prom:9090", "query": "sum(x)"}
    scaled = autoscaler_object(modelserver(actuator="keda", prometheus=prometheus))
    assert scaled is not None and scaled["kind"] == "ScaledObject"
    assert scaled["spec"]["triggers"][0]["metadata"]["query"] == "sum(x)"
    jsonschema.validate(scaled, scaled_object_schema)


def test_keda_without_prometheus_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match=r"needs spec\.autoscaling\.prometheus\.serverAddress"):
        autoscaler_object(modelserver(actuator="keda"))
