"""The router's Prometheus metrics (`inflight_router:` prefix), in a registry per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inflight.router.pool import ModelPool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)  # fmt: skip
HOLD_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Outcome:
    """`outcome` label values of inflight_router:requests_total."""

    SUCCESS = "success"  # the upstream answered 2xx
    CLIENT_ERROR = "client_error"  # the upstream answered 4xx (the client's mistake)
    UPSTREAM_ERROR = "upstream_error"  # the upstream answered 5xx, or failed after the answer started
    UNREACHABLE = "unreachable"  # no replica could be reached, even after failover
    NO_REPLICA = "no_replica"  # no replica became ready within the hold timeout
    UNKNOWN_MODEL = "unknown_model"
    BAD_REQUEST = "bad_request"  # the router itself could not read the request


class Decision:
    """`decision` label values of inflight_router:routing_decisions_total."""

    AFFINITY = "affinity"  # the prompt prefix's own replica
    SPILL = "spill"  # its own replica was over the load bound: the next one on the ring
    LEAST_LOADED = "least_loaded"  # the request had no prompt to key on
    ROUND_ROBIN = "round_robin"  # --policy round-robin


class _PoolCollector(Collector):
    def __init__(self, pools: Callable[[], Mapping[str, ModelPool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily(
            "inflight_router:replicas", "Ready replicas the router routes to, by model.", labels=["model"]
        )
        in_flight = GaugeMetricFamily(
            "inflight_router:in_flight_requests",
            "Requests forwarded and not finished, by model.",
            labels=["model"],
        )
        held = GaugeMetricFamily(
            "inflight_router:held_requests",
            "Requests waiting for a ready replica (scale from zero), by model.",
            labels=["model"],
        )
        for name, pool in sorted(self._pools().items()):
            replicas.add_metric([name], len(pool.replicas))
            in_flight.add_metric([name], sum(r.in_flight for r in pool.replicas.values()))
            held.add_metric([name], pool.held)
        yield from (replicas, in_flight, held)


class RouterMetrics:
    def __init__(self, pools: Callable[[], Mapping[str, ModelPool]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pools))
        self.requests = Counter(
            "inflight_router:requests",
            "Requests by model and outcome (success, client_error, upstream_error, unreachable, "
            "no_replica, unknown_model, bad_request).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            "inflight_router:routing_decisions",
            "Replica choices by model and decision (affinity, spill, least_loaded, round_robin).",
            ["model", "decision"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "inflight_router:failovers",
            "Requests retried on another replica (connection failed or 503 before any output).",
            ["model"],
            registry=self.registry,
        )
        self.hold_seconds = Histogram(
            "inflight_router:hold_seconds",
            "Seconds a request waited for a ready replica (scale from zero), by model.",
            ["model"],
            buckets=HOLD_BUCKETS,
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "inflight_router:upstream_latency_seconds",
            "Seconds from sending a request upstream to its first response bytes (for a stream: about the "
            "time to first token), by model.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
