"""A real Prometheus scrapes a running `inflight serve` (tiny model) and the operator's /metrics, loads the
chart's alert rules, and answers every dashboard panel's and every alert's query (a real-component test).

Prometheus runs on loopback with a 1 s scrape and evaluation interval; the server's series get the
`namespace`, `modelserver` and `pod` labels the chart's PodMonitor gives them, and the operator's job keeps
its own labels as the ServiceMonitor does (honorLabels). The operator's metrics come from the real
`OperatorMetrics` holding a status that the real `build_status` computed for a drifting replica.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from inflight.operator.api.types import ModelServer
from inflight.operator.autoscaling.pod_metrics import PodSizing
from inflight.operator.metrics import OperatorMetrics, serve_metrics
from inflight.operator.placement import place
from inflight.operator.status import Observed, build_status

from support.monitoring_kit import PrometheusTools, alert_queries, dashboard_queries, selectors
from support.processes import free_port, stop_processes

pytestmark = pytest.mark.timeout(180)

LABELS = {"namespace": "ml", "modelserver": "tiny", "pod": "tiny-0"}
GRAFANA_VARIABLES = {"$namespace": ".*", "$modelserver": ".*", "$__rate_interval": "1m"}
# Selectors that a healthy run legitimately never fills: only their metric and label names are checked.
ABSENT_WHEN_HEALTHY = {("inflight:http_responses_total", '{status_code=~"5.."}')}
DOCS = Path(__file__).parents[2] / "docs" / "monitoring.md"


@pytest.fixture
def server(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[str]:
    """`inflight serve` with one slot and no queue, so a burst of requests gets 429s."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "inflight.cli",
        "serve",
        "--model",
        str(tiny_llama_dir),
        "--port",
        str(port),
    ]
    command += ["--served-model-name", "tiny", "--max-slots", "1", "--max-queue", "0"]
    with open(tmp_path / "server.log", "wb") as log:
        process = subprocess.Popen(
            command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log
        )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes([process])


@pytest.fixture
async def operator_metrics() -> AsyncIterator[str]:
    """The operator's /metrics with one ModelServer whose second replica runs short of the plan."""
    metrics = OperatorMetrics()
    ms = ModelServer.model_validate(
        {
            "metadata": {"name": "tiny", "namespace": "ml", "generation": 1},
            "spec": {
                "model": {"name": "tiny", "source": "builtin:tiny"},
                "resources": {"gpu": {"count": 0}, "memory": "2Gi"},
            },
        }
    )
    placement = place(ms.spec, [])
    plan = placement.plan
    measured = {
        "tiny-0": PodSizing(plan.kv_blocks, plan.slots, plan.dtype, None),
        "tiny-1": PodSizing(plan.kv_blocks // 2, plan.slots, plan.dtype, None),
    }
    status = build_status(ms, Observed(placement, None, None, 2, "h", measured), "2026-01-01T00:00:00Z")
    metrics.record_status("ml", "tiny", status, 2)
    metrics.reconciles.labels(result="ok").inc()
    port = free_port()
    runner = await serve_metrics(metrics, "127.0.0.1", port)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
def prometheus(
    prometheus_tools: PrometheusTools,
    rule_groups: list[dict[str, Any]],
    server: str,
    operator_metrics: str,
    tmp_path: Path,
) -> Iterator[str]:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}, sort_keys=False))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {"job_name": "inflight-servers", "static_configs": [{"targets": [server], "labels": LABELS}]},
            {
                "job_name": "inflight-operator",
                "honor_labels": True,
                "static_configs": [{"targets": [operator_metrics]}],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        str(prometheus_tools.prometheus),
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with open(tmp_path / "prometheus.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, cwd=tmp_path)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_processes([process])


async def wait_for(check: Any, what: str, timeout: float = 90.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.2)


async def query(http: httpx.AsyncClient, prometheus: str, promql: str) -> list[dict[str, Any]]:
    response = await http.get(f"{prometheus}/api/v1/query", params={"query": promql})
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def send_traffic(http: httpx.AsyncClient, server: str) -> None:
    """Finished requests (one prompt thrice: prefix-cache hits), then requests while a stream holds the one
    slot, until one is refused with 429 (the stream is dropped after, which aborts it)."""
    url = f"http://{server}/v1/completions"
    body = {"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog " * 4, "max_tokens": 8}
    for _ in range(3):
        response = await http.post(url, json=body)
        assert response.status_code == 200, response.text
    holding = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        async with http.stream("POST", url, json=holding) as stream:
            assert stream.status_code == 200
            await anext(stream.aiter_lines())  # the first token: the slot is taken
            refused = await http.post(url, json=body)
        if refused.status_code == 429:
            return
        assert refused.status_code == 200, refused.text  # the stream finished first; try again
        assert asyncio.get_running_loop().time() < deadline, "never got a 429 with the one slot taken"


def documented_server_metrics() -> set[str]:
    """The server metrics docs/monitoring.md lists, as written there (without labels)."""
    return set(re.findall(r"^\| `(inflight:[a-z0-9_:]+)", DOCS.read_text(), flags=re.MULTILINE))


async def test_every_dashboard_and_alert_query_returns_data_from_a_real_prometheus(
    prometheus: str, server: str
) -> None:
    async with httpx.AsyncClient(timeout=60) as http:

        async def up() -> bool:
            try:
                ready = await http.get(f"http://{server}/ready")
                return (
                    ready.status_code == 200 and (await http.get(f"{prometheus}/-/ready")).status_code == 200
                )
            except httpx.HTTPError:
                return False

        await wait_for(up, "the server and Prometheus")
        await send_traffic(http, server)

        async def scraped_after_traffic() -> bool:  # rates need two samples of the newest series (the 429s)
            promql = 'count_over_time(inflight:http_responses_total{status_code="429"}[1m])'
            samples = await query(http, prometheus, promql)
            return bool(samples) and float(samples[0]["value"][1]) >= 3

        await wait_for(scraped_after_traffic, "Prometheus to scrape the traffic")

        panels = dashboard_queries()
        for title, promql in panels.items():
            for variable, value in GRAFANA_VARIABLES.items():
                promql = promql.replace(variable, value)
            assert await query(http, prometheus, promql), (
                f"dashboard panel {title!r} returns no data: {promql}"
            )

        alerts = alert_queries(await rule_groups_loaded(http, prometheus))
        for alert, promql in alerts.items():
            await query(http, prometheus, promql)  # the expression evaluates (empty: not firing)
            for name, matchers in selectors(promql):
                if (name, matchers) in ABSENT_WHEN_HEALTHY:
                    label = matchers.strip("{}").split("=")[0]
                    assert await query(http, prometheus, f'{name}{{{label}!=""}}'), (alert, name, label)
                else:
                    assert await query(http, prometheus, name + matchers), (
                        f"{alert}: {name}{matchers} is empty"
                    )

        text = (await http.get(f"http://{server}/metrics")).text
    exported = {  # family names (histograms) and sample names (counters' _total, the info's _info)
        name
        for family in text_string_to_metric_families(text)
        for name in (family.name, *(sample.name for sample in family.samples))
    }
    documented = documented_server_metrics()
    assert len(documented) >= 16 and documented <= exported, f"not exported: {documented - exported}"
    queried = {name for promql in [*panels.values(), *alerts.values()] for name, _ in selectors(promql)}
    unread = {doc for doc in documented if not {doc, f"{doc}_bucket"} & queried}
    assert not unread, f"documented server metrics that no panel or alert reads: {unread}"


async def rule_groups_loaded(http: httpx.AsyncClient, prometheus: str) -> list[dict[str, Any]]:
    """The rule groups as Prometheus loaded and evaluated them: every rule healthy (no evaluation error)."""

    async def evaluated() -> list[dict[str, Any]] | None:
        groups: list[dict[str, Any]] = (await http.get(f"{prometheus}/api/v1/rules")).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return (
            groups
            if rules and all(rule.get("lastEvaluation", "").startswith("2") for rule in rules)
            else None
        )

    groups = await wait_for(evaluated, "every rule evaluated")
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
            rule["alert"] = rule["name"]
            rule["expr"] = rule["query"]
    return list(groups)
