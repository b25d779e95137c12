"""The operator's own /metrics: reconciles by result and duration, API errors, ModelServers by condition."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight.operator.api.resources import MODELSERVERS as MODELSERVER_RESOURCE
from inflight.operator.controller import Controller
from inflight.operator.kube import OPERATOR_USER_AGENT, KubeClient, KubeError, configuration_for
from inflight.operator.metrics import OperatorMetrics, serve_metrics

from support.emulated import MODELSERVERS, emulated_cluster

MS_URL = "/apis/inflight.dev/v1alpha1/namespaces/ns/modelservers"


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }


def modelserver(name: str, memory: str) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "source": "builtin:tiny"},
            "resources": {"gpu": {"count": 0}, "memory": memory},
        },
    }


async def test_reconciles_api_errors_and_conditions_are_counted() -> None:
    metrics = OperatorMetrics()
    async with emulated_cluster() as cluster:
        client = KubeClient(
            configuration_for(str(cluster.url)), user_agent=OPERATOR_USER_AGENT, on_error=metrics.api_error
        )
        controller = Controller(client, lambda *_: None, metrics)
        try:
            for name, memory in (("fits", "2Gi"), ("too-small", "256Mi")):
                response = await cluster.post(MS_URL, json=modelserver(name, memory))
                assert response.status in (200, 201), await response.text()
                await controller.reconcile("ns", name)
            with pytest.raises(KubeError):  # the object exists: 409
                await client.create(MODELSERVER_RESOURCE.path("ns"), modelserver("fits", "2Gi"))
            assert cluster.stored(MODELSERVERS, "ns", "fits") is not None
        finally:
            await controller.close()

    found = samples(metrics)
    assert found[("inflight_operator_reconciles_total", (("result", "ok"),))] == 1
    assert found[("inflight_operator_reconciles_total", (("result", "degraded"),))] == 1
    assert found[("inflight_operator_reconcile_duration_seconds_count", ())] == 2
    assert found[("inflight_operator_api_errors_total", (("code", "409"), ("method", "POST")))] == 1
    degraded = (("condition", "Degraded"), ("status", "True"))
    assert found[("inflight_operator_modelservers", degraded)] == 1
    assert found[("inflight_operator_modelservers", (("condition", "Sized"), ("status", "True")))] == 1
    one = (("condition", "Degraded"), ("modelserver", "too-small"), ("namespace", "ns"))
    assert found[("inflight_operator_modelserver_condition", (*one, ("status", "True")))] == 1
    assert found[("inflight_operator_modelserver_condition", (*one, ("status", "False")))] == 0
    replicas = (("kind", "desired"), ("modelserver", "fits"), ("namespace", "ns"))
    assert found[("inflight_operator_modelserver_replicas", replicas)] == 1

    controller.forget("ns", "too-small")  # deleted: its series go
    assert not [key for key in samples(metrics) if ("modelserver", "too-small") in key[1]]


async def test_an_exception_counts_as_an_error_and_an_unreachable_api_as_a_connection_error() -> None:
    metrics = OperatorMetrics()
    client = KubeClient(
        configuration_for("http://127.0.0.1:9"), user_agent=OPERATOR_USER_AGENT, on_error=metrics.api_error
    )
    controller = Controller(client, lambda *_: None, metrics)
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever aiohttp raises for a refused connection
            await controller.reconcile("ns", "m")
    finally:
        await controller.close()
    found = samples(metrics)
    assert found[("inflight_operator_reconciles_total", (("result", "error"),))] == 1
    assert found[("inflight_operator_api_errors_total", (("code", "connection"), ("method", "GET")))] == 1


async def test_the_metrics_endpoint_serves_prometheus_text(unused_tcp_port: int) -> None:
    metrics = OperatorMetrics()
    metrics.autoscaling_decisions.labels(direction="up").inc()
    runner = await serve_metrics(metrics, "127.0.0.1", unused_tcp_port)
    try:
        async with httpx.AsyncClient() as http:
            response = await http.get(f"http://127.0.0.1:{unused_tcp_port}/metrics")
    finally:
        await runner.cleanup()
    assert response.headers["content-type"].startswith("text/plain")
    assert 'inflight_operator_autoscaling_decisions_total{direction="up"} 1.0' in response.text
    assert json.dumps("inflight_operator_reconciles_total")[1:-1] in response.text


async def test_a_download_poll_that_fails_is_logged_and_close_waits_for_every_poll(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A delayed reconcile is a task of its own: an API error in it must not end the operator (Kopf
    re-raises its tasks' errors), and closing the controller cancels it before the client closes."""
    client = KubeClient(configuration_for("http://127.0.0.1:9"), user_agent=OPERATOR_USER_AGENT)
    controller = Controller(client, lambda *_: None)
    controller.download_poll_seconds = 0
    controller._poll_download("ns", "a")
    (task,) = controller._poll_tasks
    await task
    assert "download poll of ns/a failed" in caplog.text
    controller.download_poll_seconds = 3600
    controller._poll_download("ns", "b")
    (pending,) = controller._poll_tasks
    await controller.close()
    assert pending.cancelled() and not controller._poll_tasks
