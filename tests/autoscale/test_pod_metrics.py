"""Reading the autoscaling metric from pods: parsing the server's text format, finding pods, scraping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from inflight.operator.api.types import AutoscalingMetric
from inflight.operator.autoscaling.pod_metrics import (
    MetricsFormatError,
    PodEndpoint,
    metric_value,
    ready_pod_endpoints,
    scrape,
)

BODY = """\
# HELP inflight:num_requests_running Requests in a slot.
# TYPE inflight:num_requests_running gauge
inflight:num_requests_running{model_name="tiny"} 3.0
# HELP inflight:num_requests_waiting Requests waiting for a slot.
# TYPE inflight:num_requests_waiting gauge
inflight:num_requests_waiting{model_name="tiny"} 5.0
# HELP inflight:kv_cache_usage_perc Fraction of KV blocks in use.
# TYPE inflight:kv_cache_usage_perc gauge
inflight:kv_cache_usage_perc{model_name="tiny"} 0.625
# HELP inflight:e2e_request_latency_seconds End to end latency.
# TYPE inflight:e2e_request_latency_seconds histogram
inflight:e2e_request_latency_seconds_bucket{le="1.0",model_name="tiny"} 2.0
inflight:e2e_request_latency_seconds_bucket{le="+Inf",model_name="tiny"} 2.0
inflight:e2e_request_latency_seconds_count{model_name="tiny"} 2.0
inflight:e2e_request_latency_seconds_sum{model_name="tiny"} 0.5
"""


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        (AutoscalingMetric.REQUESTS_IN_FLIGHT, 8.0),
        (AutoscalingMetric.QUEUE_DEPTH, 5.0),
        (AutoscalingMetric.KV_CACHE_USAGE, 0.625),
    ],
)
def test_metric_value_from_server_text(metric: AutoscalingMetric, expected: float) -> None:
    assert metric_value(BODY, metric) == expected


def test_metric_value_sums_over_labels() -> None:
    body = (
        'inflight:num_requests_waiting{model_name="a"} 2\ninflight:num_requests_waiting{model_name="b"} 3\n'
    )
    assert metric_value(body, AutoscalingMetric.QUEUE_DEPTH) == 5.0


def test_missing_series_is_an_error_not_zero() -> None:
    body = "inflight:num_requests_running 1\n"
    with pytest.raises(MetricsFormatError, match="no inflight:num_requests_waiting"):
        metric_value(body, AutoscalingMetric.REQUESTS_IN_FLIGHT)


def test_garbage_is_an_error() -> None:
    with pytest.raises(MetricsFormatError, match="not Prometheus text"):
        metric_value("<html>502 Bad Gateway</html>\n", AutoscalingMetric.QUEUE_DEPTH)


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    port: int | None = 8000,
    deleting: bool = False,
) -> dict[str, object]:
    ports = [{"name": "http", "containerPort": port}] if port is not None else []
    metadata: dict[str, object] = {"name": name}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, object] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {
        "metadata": metadata,
        "spec": {
            "containers": [
                {"name": "sidecar", "ports": [{"name": "http", "containerPort": 1}]},
                {"name": "server", "ports": ports},
            ]
        },
        "status": status,
    }


def test_ready_pod_endpoints_take_the_server_containers_http_port() -> None:
    pods = [
        pod("b", ip="10.0.0.2", port=9001),
        pod("a"),
        pod("starting", ready=False),
        pod("no-ip", ip=None),
        pod("no-port", port=None),
        pod("terminating", deleting=True),
    ]
    assert ready_pod_endpoints(pods, container="server") == [
        PodEndpoint("a", "10.0.0.1", 8000),
        PodEndpoint("b", "10.0.0.2", 9001),
    ]
    assert PodEndpoint("v6", "fd00::1", 8000).metrics_url == "http://[fd00::1]:8000/metrics"


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A TCP server that accepts connections and never answers."""

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def test_scrape_marks_unanswered_and_broken_pods_unknown(silent_port: int) -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.1":
            return httpx.Response(200, text=BODY)
        if request.url.host == "10.0.0.2":
            return httpx.Response(503, text="starting")
        raise httpx.ConnectError("connection refused", request=request)

    mocked = httpx.AsyncClient(transport=httpx.MockTransport(respond))
    values = await scrape(
        mocked,
        [
            PodEndpoint("ok", "10.0.0.1", 8000),
            PodEndpoint("503", "10.0.0.2", 8000),
            PodEndpoint("refused", "10.0.0.3", 8000),
        ],
        AutoscalingMetric.QUEUE_DEPTH,
        timeout_s=1.0,
    )
    assert values == {"ok": 5.0, "503": None, "refused": None}

    async with httpx.AsyncClient() as real:
        hung = await scrape(
            real, [PodEndpoint("hung", "127.0.0.1", silent_port)], AutoscalingMetric.QUEUE_DEPTH, 0.2
        )
    assert hung == {"hung": None}


def test_pod_sizing_reads_the_kv_cache_dtype_from_engine_info() -> None:
    from inflight.operator.autoscaling.pod_metrics import ENGINE_INFO, KV_BLOCKS, SLOTS, pod_sizing

    labels = 'dtype="bfloat16",kv_cache_dtype="float8_e4m3fn",tensor_parallel_size="2"'
    sizing = pod_sizing(f"{KV_BLOCKS} 300\n{SLOTS} 8\n{ENGINE_INFO}{{{labels}}} 1.0\n")
    assert (sizing.kv_blocks, sizing.dtype, sizing.kv_cache_dtype, sizing.tensor_parallel) == (
        300,
        "bfloat16",
        "float8_e4m3fn",
        2,
    )
