"""Pure builders for the external autoscalers: an ``autoscaling/v2`` HPA and a KEDA ``ScaledObject``.

Both target the ModelServer's scale subresource, so the HPA (or KEDA's HPA) is the one writer of
``ModelServer.spec.replicas`` and the operator only carries that count to the Deployment.
Both use the same rule as the builtin scaler: ``desired = ceil(total metric over pods / target)``,
which is an ``AverageValue`` target of ``target`` per pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from inflight.operator.api.types import API_VERSION, KIND, Actuator, AutoscalingMetric, ModelServer
from inflight.operator.autoscaling.decision import ScalingPolicy, policy_of
from inflight.operator.autoscaling.pod_metrics import SERIES
from inflight.operator.children import server

HPA_METRIC_NAMES: dict[AutoscalingMetric, str] = {
    AutoscalingMetric.REQUESTS_IN_FLIGHT: "inflight:num_requests_in_flight",
    AutoscalingMetric.QUEUE_DEPTH: "inflight:num_requests_waiting",
    AutoscalingMetric.KV_CACHE_USAGE: "inflight:kv_cache_usage_perc",
}
"""The custom-metrics name the HPA asks for. Two are the server's own series; requests in flight is
running + waiting, which the Prometheus Adapter rule in docs/autoscaling.md publishes under its name."""


def autoscaler_object(ms: ModelServer) -> dict[str, Any] | None:
    """The HPA (actuator hpa) or ScaledObject (actuator keda) the ModelServer asks for; else None.

    Raises ValueError with what to change when the spec cannot be expressed (see the builders).
    """
    autoscaling = ms.spec.autoscaling
    if autoscaling is None or autoscaling.actuator is Actuator.BUILTIN:
        return None
    name, namespace = ms.metadata.name, ms.metadata.namespace
    policy = policy_of(autoscaling)
    owner, labels = server.owner_reference(ms), server.labels(ms)
    if autoscaling.actuator is Actuator.HPA:
        return build_hpa(name, namespace, policy, autoscaling.metric, owner, labels)
    prometheus = autoscaling.prometheus
    return build_scaled_object(
        name,
        namespace,
        policy,
        autoscaling.metric,
        owner,
        labels,
        server_address=prometheus.server_address if prometheus else "",
        query=prometheus.query if prometheus else None,
    )


def quantity(value: float) -> str:
    """A Kubernetes quantity for a target: whole numbers plain, fractions in milli-units (0.8 -> 800m)."""
    milli = Decimal(str(value)) * 1000
    if milli != milli.to_integral_value():
        raise ValueError(f"target {value} is finer than a thousandth; Kubernetes quantities cannot hold it")
    if milli % 1000 == 0:
        return str(int(milli / 1000))
    return f"{int(milli)}m"


def build_hpa(
    name: str,
    namespace: str,
    policy: ScalingPolicy,
    metric: AutoscalingMetric,
    owner_reference: Mapping[str, Any],
    labels: Mapping[str, str],
    metric_name: str | None = None,
) -> dict[str, Any]:
    """An HPA on the ModelServer's scale subresource with a Pods metric (served by Prometheus Adapter)."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(name, namespace, owner_reference, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicas": policy.min_replicas,
            "maxReplicas": policy.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric_name or HPA_METRIC_NAMES[metric]},
                        "target": {"type": "AverageValue", "averageValue": quantity(policy.target)},
                    },
                }
            ],
            "behavior": _behavior(policy),
        },
    }


def prometheus_query(metric: AutoscalingMetric, namespace: str, deployment: str) -> str:
    """PromQL for the metric's total over the Deployment's pods (KEDA divides it by the replica count)."""
    selector = f'namespace="{namespace}",pod=~"{deployment}-[a-z0-9]+-[a-z0-9]+"'
    return " + ".join(f"sum({series}{{{selector}}})" for series in SERIES[metric])


def build_scaled_object(
    name: str,
    namespace: str,
    policy: ScalingPolicy,
    metric: AutoscalingMetric,
    owner_reference: Mapping[str, Any],
    labels: Mapping[str, str],
    server_address: str,
    query: str | None = None,
    polling_interval_s: int = 15,
) -> dict[str, Any]:
    """A KEDA ScaledObject on the ModelServer's scale subresource with a Prometheus trigger.

    ``query`` must return the metric's total over the ModelServer's pods; without one it is built from the
    metric, assuming Prometheus labels series with ``namespace`` and ``pod`` (as pod and ServiceMonitor
    scrape configs do) and the Deployment is named after the ModelServer.
    """
    if not server_address:
        raise ValueError("the keda actuator needs spec.autoscaling.prometheus.serverAddress")
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(name, namespace, owner_reference, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicaCount": policy.min_replicas,
            "maxReplicaCount": policy.max_replicas,
            "pollingInterval": polling_interval_s,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(policy)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": server_address,
                        "query": query or prometheus_query(metric, namespace, name),
                        "threshold": f"{policy.target:g}",
                    },
                }
            ],
        },
    }


HPA_MAX_WINDOW_S = 3600
"""Kubernetes rejects an HPA stabilization window above one hour."""


def _behavior(policy: ScalingPolicy) -> dict[str, Any]:
    if policy.scale_down_delay_s > HPA_MAX_WINDOW_S:
        raise ValueError(
            f"autoscaling.scaleDownDelaySeconds is {policy.scale_down_delay_s:g}, but an HPA's scale-down "
            f"window is at most {HPA_MAX_WINDOW_S}s; lower it, or use actuator builtin"
        )
    return {
        "scaleUp": {"stabilizationWindowSeconds": round(policy.scale_up_stabilization_s)},
        "scaleDown": {"stabilizationWindowSeconds": round(policy.scale_down_delay_s)},
    }


def _metadata(
    name: str, namespace: str, owner_reference: Mapping[str, Any], labels: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels),
        "ownerReferences": [dict(owner_reference)],
    }
