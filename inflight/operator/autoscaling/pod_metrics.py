"""Read the server's metrics from pods: the autoscaling catalogue, what each pod really sized, a scraper.

The server exports Prometheus text on ``/metrics`` (names mirror vLLM's). Each autoscaling metric is the
sum of one or more of those series on one pod:

- ``requestsInFlight``: requests a replica has accepted and not finished — running plus waiting;
- ``queueDepth``: requests waiting for a slot;
- ``kvCacheUsage``: the fraction of the KV block pool in use, 0.0 to 1.0 (not percent).

`pod_sizing` reads what a pod's engine actually runs with (KV blocks, slots, dtype, tensor-parallel degree),
which the operator compares with its plan (``status.sizing.measured``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inflight.operator.api.types import AutoscalingMetric

RUNNING = "inflight:num_requests_running"
WAITING = "inflight:num_requests_waiting"
KV_CACHE_USAGE = "inflight:kv_cache_usage_perc"
KV_BLOCKS = "inflight:kv_cache_blocks_total"
SLOTS = "inflight:max_slots"
ENGINE_INFO = "inflight:engine_info"  # labels: dtype, and tensor_parallel_size where the server exports it


SERIES: dict[AutoscalingMetric, tuple[str, ...]] = {
    AutoscalingMetric.REQUESTS_IN_FLIGHT: (RUNNING, WAITING),
    AutoscalingMetric.QUEUE_DEPTH: (WAITING,),
    AutoscalingMetric.KV_CACHE_USAGE: (KV_CACHE_USAGE,),
}
"""The server series whose sum is each metric's value on one pod."""


class MetricsFormatError(ValueError):
    """The body was not Prometheus text, or lacked a series the metric needs."""


def metric_value(text: str, metric: AutoscalingMetric) -> float:
    """The metric's value in one pod's ``/metrics`` body (summed over labels such as ``model_name``)."""
    wanted = SERIES[metric]
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except ValueError as error:
        raise MetricsFormatError(f"not Prometheus text format: {error}") from error
    missing = [name for name in wanted if name not in totals]
    if missing:
        raise MetricsFormatError(
            f"/metrics has no {', '.join(missing)}; is this an inflight server of a matching version?"
        )
    return sum(totals.values())


@dataclass(frozen=True)
class PodSizing:
    """What one pod's engine runs with, as its /metrics says."""

    kv_blocks: int
    slots: int
    dtype: str | None
    tensor_parallel: int | None
    kv_cache_dtype: str | None = None


def pod_sizing(text: str) -> PodSizing:
    """The sizing one pod's ``/metrics`` body reports."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (KV_BLOCKS, SLOTS):
                    values[sample.name] = float(sample.value)
                elif sample.name == ENGINE_INFO:
                    info = dict(sample.labels)
    except ValueError as error:
        raise MetricsFormatError(f"not Prometheus text format: {error}") from error
    missing = [name for name in (KV_BLOCKS, SLOTS) if name not in values]
    if missing:
        raise MetricsFormatError(
            f"/metrics has no {', '.join(missing)}; is this an inflight server of a matching version?"
        )
    tensor_parallel = info.get("tensor_parallel_size")
    return PodSizing(
        kv_blocks=int(values[KV_BLOCKS]),
        slots=int(values[SLOTS]),
        dtype=info.get("dtype"),
        tensor_parallel=int(tensor_parallel) if tensor_parallel and tensor_parallel.isdigit() else None,
        kv_cache_dtype=info.get("kv_cache_dtype"),
    )


@dataclass(frozen=True)
class PodEndpoint:
    name: str
    ip: str
    port: int

    @property
    def url(self) -> str:
        """Where the pod's server listens: http://IP:PORT."""
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"


SERVER_PORT_NAME = "http"


def ready_pod_endpoints(pods: Iterable[Mapping[str, object]], container: str) -> list[PodEndpoint]:
    """The ready, not terminating pods and where their server listens.

    The port is the ``containerPort`` named ``http`` of the container named ``container`` (the Deployment's
    server container); pods without an IP or without that port are skipped, as they serve no traffic.
    """
    endpoints = []
    for pod in pods:
        metadata = _mapping(pod.get("metadata"))
        status = _mapping(pod.get("status"))
        if metadata.get("deletionTimestamp") or not _is_ready(status):
            continue
        ip = status.get("podIP")
        port = _server_port(_mapping(pod.get("spec")), container)
        if isinstance(ip, str) and ip and port is not None:
            endpoints.append(PodEndpoint(name=str(metadata.get("name", "")), ip=ip, port=port))
    return sorted(endpoints, key=lambda endpoint: endpoint.name)


async def scrape(
    client: httpx.AsyncClient, endpoints: Iterable[PodEndpoint], metric: AutoscalingMetric, timeout_s: float
) -> dict[str, float | None]:
    """Each pod's metric value, scraped concurrently; None for a pod that did not answer in time or well."""
    endpoint_list = list(endpoints)
    values = await asyncio.gather(*(_scrape_one(client, e, metric, timeout_s) for e in endpoint_list))
    return {endpoint.name: value for endpoint, value in zip(endpoint_list, values, strict=True)}


async def scrape_sizing(
    client: httpx.AsyncClient, endpoints: Iterable[PodEndpoint], timeout_s: float
) -> dict[str, PodSizing]:
    """The sizing of each pod that answered in time and well (the others are left out)."""
    endpoint_list = list(endpoints)
    texts = await asyncio.gather(*(_fetch(client, e, timeout_s) for e in endpoint_list))
    measured = {}
    for endpoint, text in zip(endpoint_list, texts, strict=True):
        if text is not None:
            with contextlib.suppress(MetricsFormatError):
                measured[endpoint.name] = pod_sizing(text)
    return measured


async def _fetch(client: httpx.AsyncClient, endpoint: PodEndpoint, timeout_s: float) -> str | None:
    try:
        response = await client.get(endpoint.metrics_url, timeout=timeout_s)
        response.raise_for_status()
        return response.text
    except httpx.HTTPError:
        return None


async def _scrape_one(
    client: httpx.AsyncClient, endpoint: PodEndpoint, metric: AutoscalingMetric, timeout_s: float
) -> float | None:
    text = await _fetch(client, endpoint, timeout_s)
    if text is None:
        return None
    try:
        return metric_value(text, metric)
    except MetricsFormatError:
        return None


def _is_ready(status: Mapping[str, object]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _server_port(spec: Mapping[str, object], container: str) -> int | None:
    containers = spec.get("containers")
    if not isinstance(containers, list):
        return None
    for candidate in containers:
        if isinstance(candidate, dict) and candidate.get("name") == container:
            for port in candidate.get("ports") or []:
                if isinstance(port, dict) and port.get("name") == SERVER_PORT_NAME:
                    number = port.get("containerPort")
                    return number if isinstance(number, int) else None
    return None


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}
