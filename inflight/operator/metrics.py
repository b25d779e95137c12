"""The operator's own Prometheus metrics (`inflight_operator_` prefix), served on `--metrics-address`.

Each operator owns its registry (tests run several operators in one process). Counters and the reconcile
histogram are updated where the work happens; the per-ModelServer series are rendered at scrape time from
the last status each reconcile computed, so a deleted ModelServer's series vanish with it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONDITION_STATUSES = ("True", "False", "Unknown")


class _ModelServerCollector(Collector):
    """Per-ModelServer series from the statuses the reconciles computed (namespace, name) -> status."""

    def __init__(self) -> None:
        self.statuses: dict[tuple[str, str], Mapping[str, Any]] = {}

    def collect(self) -> Iterator[Metric]:
        by_condition = GaugeMetricFamily(
            "inflight_operator_modelservers",
            "ModelServers by condition type and status.",
            labels=["condition", "status"],
        )
        condition = GaugeMetricFamily(
            "inflight_operator_modelserver_condition",
            "1 when the ModelServer's condition has this status (one series per condition type and status).",
            labels=["namespace", "modelserver", "condition", "status"],
        )
        replicas = GaugeMetricFamily(
            "inflight_operator_modelserver_replicas",
            "Replicas of the ModelServer's Deployment: desired (what the operator asks for) and ready.",
            labels=["namespace", "modelserver", "kind"],
        )
        planned = GaugeMetricFamily(
            "inflight_operator_modelserver_kv_blocks_planned",
            "KV-cache blocks per replica in the sizing plan.",
            labels=["namespace", "modelserver"],
        )
        measured = GaugeMetricFamily(
            "inflight_operator_modelserver_kv_blocks_measured_min",
            "Fewest KV-cache blocks a ready replica reports (status.sizing.measured.kvBlocksMin).",
            labels=["namespace", "modelserver"],
        )
        counts: dict[tuple[str, str], int] = {}
        for (namespace, name), status in sorted(self.statuses.items()):
            present = {c["type"]: c["status"] for c in status.get("conditions") or []}
            for kind, value in present.items():
                counts[(kind, value)] = counts.get((kind, value), 0) + 1
                for candidate in CONDITION_STATUSES:
                    condition.add_metric([namespace, name, kind, candidate], float(candidate == value))
            replicas.add_metric([namespace, name, "desired"], float(status.get("desiredReplicas", 0)))
            replicas.add_metric([namespace, name, "ready"], float(status.get("readyReplicas", 0)))
            sizing = status.get("sizing") or {}
            if sizing.get("kvBlocks") is not None:
                planned.add_metric([namespace, name], float(sizing["kvBlocks"]))
            if (sizing.get("measured") or {}).get("kvBlocksMin") is not None:
                measured.add_metric([namespace, name], float(sizing["measured"]["kvBlocksMin"]))
        for (kind, value), count in sorted(counts.items()):
            by_condition.add_metric([kind, value], float(count))
        yield from (by_condition, condition, replicas, planned, measured)


class OperatorMetrics:
    """The operator's registry and the instruments the controller, the client and the autoscaler update."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._modelservers = _ModelServerCollector()
        self.registry.register(self._modelservers)
        self.reconciles = Counter(
            "inflight_operator_reconciles",
            "Reconciles by result: ok, degraded (the spec cannot work as written) or error (an exception).",
            ["result"],
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "inflight_operator_reconcile_duration_seconds",
            "Seconds one reconcile of a ModelServer took.",
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self.api_errors = Counter(
            "inflight_operator_api_errors",
            "Failed Kubernetes API calls of the operator's client by method and HTTP status "
            "(`connection` when none came back).",
            ["method", "code"],
            registry=self.registry,
        )
        self.autoscaling_decisions = Counter(
            "inflight_operator_autoscaling_decisions",
            "Builtin autoscaler decisions by direction (up, down, hold).",
            ["direction"],
            registry=self.registry,
        )
        for result in ("ok", "degraded", "error"):
            self.reconciles.labels(result=result)
        for direction in ("up", "down", "hold"):
            self.autoscaling_decisions.labels(direction=direction)

    def api_error(self, method: str, code: str) -> None:
        self.api_errors.labels(method=method, code=code).inc()

    def record_status(
        self, namespace: str, name: str, status: Mapping[str, Any], desired_replicas: int
    ) -> None:
        """The status a reconcile computed and the replicas it asks for: the per-ModelServer series."""
        self._modelservers.statuses[(namespace, name)] = {**status, "desiredReplicas": desired_replicas}

    def forget(self, namespace: str, name: str) -> None:
        self._modelservers.statuses.pop((namespace, name), None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(metrics: OperatorMetrics, host: str, port: int) -> web.AppRunner:
    """Serve `GET /metrics` on host:port (every replica, leader or standby, answers)."""

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
