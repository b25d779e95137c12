"""The router's HTTP app: OpenAI routes forwarded by model, `/v1/models` from the pools, probes, metrics.

A request names its model; the model's pool is chosen by that name (unknown -> the OpenAI 404 body).
A pool with no ready replica holds the request (asking the operator for one when the model scales from
zero) in a bounded queue until a replica is ready or the hold timeout passes (-> 503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from inflight import __version__
from inflight.router.metrics import Outcome, RouterMetrics
from inflight.router.pool import ModelPool
from inflight.router.proxy import Policy, forward, forwarded_headers
from inflight.router.routing_key import DEFAULT_KEY_CHARS, routing_key
from inflight.router.scrape import scrape_forever
from inflight.server.errors import APIError, install_error_handlers

log = logging.getLogger("inflight.router")

RETRY_AFTER_S = 10
WAKE_REPEAT_S = 10.0  # while requests are held, the operator is asked again this often
FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass(frozen=True)
class RouterSettings:
    prefix_affinity: bool = True
    epsilon: float = 0.25
    key_chars: int = DEFAULT_KEY_CHARS
    max_held: int = 256  # per model
    scrape_interval_s: float = 2.0
    connect_timeout_s: float = 5.0


Discovery = Callable[["Router"], Coroutine[None, None, None]]


@dataclass
class Router:
    """The routed models (`pools`, kept current by a discovery task) and what forwarding needs."""

    settings: RouterSettings
    pools: dict[str, ModelPool] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once discovery has seen the models at least once (the router's /ready)."""

    def __post_init__(self) -> None:
        self.metrics = RouterMetrics(lambda: self.pools)

    async def hold(self, pool: ModelPool) -> None:
        """Wait until `pool` has a replica; APIError 503 + Retry-After after its hold timeout."""
        if pool.held >= self.settings.max_held:
            self.metrics.requests.labels(model=pool.model, outcome=Outcome.NO_REPLICA).inc()
            raise APIError(
                503,
                f"Model {pool.model!r} has no ready replica and {pool.held} requests already wait for one.",
                code="no_replica",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + pool.hold_timeout_s
        pool.held += 1
        try:
            while not pool.replicas:
                if pool.wake is not None:
                    await pool.wake()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await pool.wait_for_change(min(remaining, WAKE_REPEAT_S))
        finally:
            pool.held -= 1
            self.metrics.hold_seconds.labels(model=pool.model).observe(loop.time() - started)
        if not pool.replicas:
            self.metrics.requests.labels(model=pool.model, outcome=Outcome.NO_REPLICA).inc()
            raise APIError(
                503,
                f"No replica of model {pool.model!r} became ready within {pool.hold_timeout_s:g}s; "
                "retry later.",
                code="no_replica",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )


def _model_card(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "inflight"}


def create_router_app(router: Router, discovery: Discovery) -> FastAPI:
    settings = router.settings
    policy = Policy(prefix_affinity=settings.prefix_affinity, epsilon=settings.epsilon)
    timeout = httpx.Timeout(connect=settings.connect_timeout_s, read=None, write=60.0, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    client = httpx.AsyncClient(timeout=timeout, limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(discovery(router), name="discovery"),
            asyncio.create_task(
                scrape_forever(client, lambda: router.pools, settings.scrape_interval_s), name="scrape"
            ),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await client.aclose()

    app = FastAPI(
        title="inflight router",
        version=__version__,
        summary="One OpenAI-compatible endpoint for many models: routes by model and prompt prefix.",
        lifespan=lifespan,
    )
    app.state.router = router
    install_error_handlers(app)

    @app.get("/health", tags=["probes"])
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "detail": None})

    @app.get("/ready", tags=["probes"])
    async def ready() -> JSONResponse:
        up = router.ready.is_set()
        return JSONResponse(
            {"status": "ready" if up else "loading", "detail": None}, status_code=200 if up else 503
        )

    @app.get("/metrics", tags=["probes"])
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", tags=["openai"])
    async def list_models() -> JSONResponse:
        served = [m for m, pool in sorted(router.pools.items()) if pool.replicas or pool.wake is not None]
        return JSONResponse({"object": "list", "data": [_model_card(m) for m in served]})

    @app.get("/v1/models/{model:path}", tags=["openai"])
    async def get_model(model: str) -> JSONResponse:
        if model not in router.pools:
            raise _unknown_model(model)
        return JSONResponse(_model_card(model))

    async def forward_request(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "The request body is not valid JSON.", code="invalid_json") from None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            raise APIError(400, "The request has no `model` field; see /v1/models.", param="model",
                           code="missing_model")  # fmt: skip
        pool = router.pools.get(model)
        if pool is None:
            router.metrics.requests.labels(model="", outcome=Outcome.UNKNOWN_MODEL).inc()
            raise _unknown_model(model)
        if not pool.replicas:
            await router.hold(pool)
        key = routing_key(body, settings.key_chars) if settings.prefix_affinity else None
        headers = forwarded_headers(request.headers)
        return await forward(client, pool, request.url.path, raw, headers, key, policy, router.metrics)

    for path in FORWARDED_PATHS:
        app.add_api_route(path, forward_request, methods=["POST"], tags=["openai"])
    return app


def _unknown_model(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; see /v1/models.", param="model",
                    code="model_not_found")  # fmt: skip
