"""Prometheus metrics with vLLM's names under the `inflight:` prefix (see docs/api.md).

Each app owns its registry, so tests can run many apps in one process. Engine gauges and counters
are read from the engine's latest stats snapshot at scrape time; latencies are observed per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inflight.engine.stats import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
GRAMMAR_COMPILE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


API_PATH_PREFIX = "/v1/"  # responses counted by status code: the OpenAI API, not probes or /metrics


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], info: Callable[[], Mapping[str, str]]) -> None:
        self._stats = stats
        self._info = info

    def collect(self) -> Iterator[Metric]:
        info = self._info()
        if info:  # known once the model is loaded
            yield InfoMetricFamily(
                "inflight:engine", "The loaded engine's resolved settings.", value=dict(info)
            )
        stats = self._stats()
        gauges = (
            ("inflight:num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("inflight:num_requests_waiting", "Sequences waiting for a slot.", stats.num_waiting),
            ("inflight:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", stats.kv_cache_usage),
            ("inflight:kv_cache_blocks_total", "KV blocks in the pool (the plan).", stats.num_blocks),
            ("inflight:max_slots", "Maximum concurrently running sequences (the plan).", stats.max_num_seqs),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("inflight:num_preemptions", "Sequences preempted for lack of KV blocks.", stats.num_preemptions),
            ("inflight:prompt_tokens", "Prompt tokens prefilled.", stats.num_prompt_tokens),
            ("inflight:generation_tokens", "Tokens generated.", stats.num_generation_tokens),
            (
                "inflight:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (full blocks only).",
                stats.num_prefix_cache_queries,
            ),
            (
                "inflight:prefix_cache_hits",
                "Prompt tokens found in the prefix cache (not recomputed).",
                stats.num_prefix_cache_hits,
            ),
            (
                "inflight:spec_decode_num_draft_tokens",
                "Tokens proposed by speculative decoding.",
                stats.num_draft_tokens,
            ),
            (
                "inflight:spec_decode_num_accepted_tokens",
                "Proposed tokens accepted (the target model drew the same token).",
                stats.num_accepted_tokens,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The app's registry: engine state at scrape time plus per-request latency histograms."""

    def __init__(
        self, stats: Callable[[], EngineStats], info: Callable[[], Mapping[str, str]] = dict
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, info))
        self.http_responses = Counter(
            "inflight:http_responses",
            "Responses of the OpenAI API routes by HTTP status code (429: at capacity).",
            ["status_code"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "inflight:time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "inflight:time_per_output_token_seconds",
            "Mean seconds between generated tokens of a request, after the first.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "inflight:e2e_request_latency_seconds",
            "Seconds from arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.request_success = Counter(
            "inflight:request_success",
            "Finished sequences by finish reason (stop, length, abort).",
            ["finished_reason"],
            registry=self.registry,
        )
        self.constrained_requests = Counter(
            "inflight:constrained_requests",
            "Requests whose output is constrained, by what asked (response_format, guided_json, tools, ...).",
            ["field"],
            registry=self.registry,
        )
        self.grammar_compile_time = Histogram(
            "inflight:grammar_compile_seconds",
            "Seconds a request waited for its grammar (about 0 when the grammar cache had it).",
            buckets=GRAMMAR_COMPILE_BUCKETS,
            registry=self.registry,
        )

    def observe_sequence(
        self, *, arrival: float, first_token: float | None, finish: float, tokens: int, reason: str
    ) -> None:
        """Record one finished sequence (one choice of a request)."""
        self.request_success.labels(finished_reason=reason).inc()
        self.e2e_request_latency.observe(finish - arrival)
        if first_token is not None:
            self.time_to_first_token.observe(first_token - arrival)
            if tokens > 1:
                self.time_per_output_token.observe((finish - first_token) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ResponseCountingMiddleware:
    """Counts each OpenAI API response (paths under /v1/) in `inflight:http_responses_total{status_code}`."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PATH_PREFIX):
            await self.app(scope, receive, send)
            return

        started = False

        async def send_and_count(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http_responses.labels(status_code=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        except Exception:
            if not started:  # the outer error middleware answers 500
                self.metrics.http_responses.labels(status_code="500").inc()
            raise
