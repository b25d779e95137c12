"""The chart's monitoring kit: off by default, each piece on by its value, core objects valid for Kubernetes
1.32, and the Prometheus Operator objects wired to what they scrape (selectors, port names)."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator

from inflight.operator.api.types import ModelServer
from inflight.operator.children import server as builders
from inflight.operator.kube import is_subset
from inflight.operator.placement import place

PIECES = {
    "podMonitor": {"PodMonitor"},
    "serviceMonitor": {"Service", "ServiceMonitor"},
    "prometheusRule": {"PrometheusRule"},
    "grafanaDashboard": {"ConfigMap"},
}
ALL = ("--set", ",".join(f"monitoring.{piece}.enabled=true" for piece in PIECES))
MONITORING_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def kinds(objects: list[dict[str, Any]]) -> set[str]:
    return {obj["kind"] for obj in objects}


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


def server_pod_template() -> dict[str, Any]:
    """The pod template the operator gives a ModelServer's Deployment."""
    ms = ModelServer.model_validate(
        {
            "metadata": {"name": "llama", "namespace": "ml"},
            "spec": {
                "model": {"name": "llama", "source": "builtin:tiny"},
                "resources": {"gpu": {"count": 0}},
            },
        }
    )
    template: dict[str, Any] = builders.deployment(ms, place(ms.spec, []), 1)["spec"]["template"]
    return template


def test_the_kit_is_off_by_default_and_each_piece_switches_on_alone(helm: Any) -> None:
    baseline = kinds(helm.render())
    assert not baseline & (MONITORING_KINDS | {"Service", "ConfigMap"})
    for piece, expected in PIECES.items():
        objects = helm.render("--set", f"monitoring.{piece}.enabled=true")
        assert kinds(objects) - baseline == expected, piece


def test_core_objects_pass_the_kubernetes_schema_and_the_rest_are_prometheus_operator_kinds(
    helm: Any,
) -> None:
    for obj in helm.render(*ALL):
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in MONITORING_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1", name
            assert obj["metadata"]["namespace"] == helm.namespace, name
            continue
        try:
            kubernetes_validate.validate(obj, helm.kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name} at {list(error.path)}: {error.message}")


def test_monitoring_objects_match_the_prometheus_operator_schemas(helm: Any) -> None:
    """Each CR parses with models generated from the Prometheus Operator's CRDs and loses no field on the way
    (a misspelled or misplaced field would be dropped: the operator's API server would prune it)."""
    for obj in helm.render(*ALL):
        if obj["kind"] not in MONITORING_KINDS:
            continue
        model = getattr(prometheus_operator, obj["kind"])
        parsed = model.model_validate(obj)
        dumped = parsed.model_dump(by_alias=True, exclude_none=True, mode="json")  # with schema defaults
        assert is_subset(obj, dumped), f"{obj['kind']}: a field the Prometheus Operator does not know"
        assert parsed.spec is not None


def test_pod_monitor_selects_the_server_pods_on_their_http_port(helm: Any) -> None:
    monitor = one(helm.render(*ALL), "PodMonitor")["spec"]
    template = server_pod_template()
    assert monitor["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert monitor["namespaceSelector"] == {"any": True}
    (server,) = [c for c in template["spec"]["containers"] if c["name"] == "server"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["port"] in {port["name"] for port in server["ports"]}
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+[smh]", endpoint["interval"])
    meta_label = "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", builders.LABEL_MODELSERVER)
    assert {"sourceLabels": [meta_label], "targetLabel": "modelserver"} in endpoint["relabelings"]
    watched = helm.render(*ALL, "--set", "watchNamespaces={team-a,team-b}")
    assert one(watched, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_service_monitor_selects_the_operator_metrics_service_and_its_port(helm: Any) -> None:
    objects = helm.render(*ALL)
    monitor = one(objects, "ServiceMonitor")["spec"]
    (service,) = [obj for obj in objects if obj["kind"] == "Service"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] == "metrics" and endpoint["honorLabels"] is True
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["targetPort"] in ports and port["port"] == ports["metrics"]
    assert f"--metrics-address=0.0.0.0:{ports['metrics']}" in container["args"]
    # only the metrics Service matches the monitor's selector (not another Service of the release)
    others = [o for o in objects if o["kind"] == "Service" and o is not service]
    assert not [
        o for o in others if monitor["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()
    ]


def test_dashboard_config_map_carries_the_dashboard_for_the_grafana_sidecar(helm: Any) -> None:
    config_map = one(helm.render(*ALL), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == helm.namespace
    dashboard = json.loads(config_map["data"]["inflight.json"])
    assert dashboard == json.loads((helm.chart / "dashboards" / "inflight.json").read_text())
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for wanted in ("throughput", "first token", "inter-token", "end-to-end", "running and waiting",
                   "kv cache usage", "preemptions", "prefix-cache hit rate", "429"):  # fmt: skip
        assert wanted in titles, wanted
    elsewhere = helm.render(*ALL, "--set", "monitoring.grafanaDashboard.namespace=monitoring")
    assert one(elsewhere, "ConfigMap")["metadata"]["namespace"] == "monitoring"


def test_user_labels_reach_the_monitoring_objects(helm: Any) -> None:
    labelled = ",".join(f"monitoring.{piece}.labels.release=kps" for piece in PIECES)
    for obj in helm.render(*ALL, "--set", labelled):
        if obj["kind"] in MONITORING_KINDS:
            assert obj["metadata"]["labels"]["release"] == "kps", obj["kind"]


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (("--set", "monitoring.prometheusRule.kvCacheUsageThreshold=2"), "kvCacheUsageThreshold"),
        (("--set", "monitoring.podMonitor.interval=15 seconds"), "/monitoring/podMonitor/interval"),
        (("--set", "monitoring.serviceMonitor.enable=true"), "additional properties 'enable' not allowed"),
        (("--set", "metricsPort=80"), "/metricsPort"),
    ],
)
def test_bad_monitoring_values_are_rejected(helm: Any, values: tuple[str, ...], complaint: str) -> None:
    result = helm.template(*values)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr
