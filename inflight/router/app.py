"""The router's HTTP app: OpenAI routes forwarded by model, `/v1/models` from the pools, probes, metrics.

A request names its model; the model's pool is chosen by that name (unknown -> the OpenAI 404 body).
A pool with no ready replica holds the request (asking the operator for one when the model scales from
zero) in a bounded queue until a replica is ready or the hold timeout passes (-> 503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Message, Receive, Scope, Send

from inflight import __version__
from inflight.openai_errors import APIError, echoed, install_error_handlers
from inflight.router.metrics import Outcome, RouterMetrics
from inflight.router.pool import ModelPool
from inflight.router.proxy import Policy, forward, forwarded_headers, upstream_session
from inflight.router.routing_key import DEFAULT_KEY_CHARS, routing_key
from inflight.router.scrape import scrape_forever
from inflight.router.stored_responses import STORED_RESPONSE_METHODS, STORED_RESPONSES_PREFIX, ask_replicas

RETRY_AFTER_S = 10
WAKE_REPEAT_S = 10.0  # while requests are held, the operator is asked again this often
FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize")


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


class RouterApp:
    """The router as an ASGI app.

    POSTs to the forwarded paths are served here, as plain ASGI: no framework middleware, routing or
    response classes on the hot path (they cost more than the forwarding itself). Everything else (probes,
    metrics, `/v1/models`, the app's lifespan) is the FastAPI app `rest`.
    """

    def __init__(self, router: Router, discovery: Discovery) -> None:
        self.router = router
        self.policy = Policy(prefix_affinity=router.settings.prefix_affinity, epsilon=router.settings.epsilon)
        self.session: aiohttp.ClientSession | None = None
        self.discovery = discovery
        self.rest = _rest_app(router, self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """The upstream session (forwarding and the replicas' /metrics) and the discovery and scrape tasks."""
        router = self.router
        self.session = session = upstream_session(router.settings.connect_timeout_s)
        tasks = [
            asyncio.create_task(self.discovery(router), name="discovery"),
            asyncio.create_task(
                scrape_forever(session, lambda: router.pools, router.settings.scrape_interval_s),
                name="scrape",
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
            await session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in FORWARDED_PATHS:
            try:
                if scope["method"] != "POST":
                    raise APIError(405, f"{scope['path']} takes POST.", headers={"Allow": "POST"})
                await self._forward(scope, receive, send)
            except APIError as error:
                await error.response()(scope, receive, send)
            return
        if (
            scope["type"] == "http"
            and scope["path"].startswith(STORED_RESPONSES_PREFIX)
            and scope["method"] in STORED_RESPONSE_METHODS
        ):
            await self._stored_response(scope, receive, send)
            return
        await self.rest(scope, receive, send)

    async def _stored_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.session is not None, "the lifespan opens the upstream session"
        headers = forwarded_headers(scope["headers"])
        try:
            answer = await ask_replicas(
                self.session, self.router.pools, scope["method"], scope["path"], headers
            )
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
        await send({"type": "http.response.body", "body": answer.body, "more_body": False})

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        router, settings = self.router, self.router.settings
        raw = await _read_body(receive)
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
        assert self.session is not None, "the lifespan opens the upstream session"
        async with _cancelled_when_client_leaves(receive):
            if not pool.replicas:
                await router.hold(pool)
            key = routing_key(body, settings.key_chars) if settings.prefix_affinity else None
            headers = forwarded_headers(scope["headers"])
            await forward(
                self.session, pool, scope["path"], raw, headers, key, self.policy, router.metrics, send
            )


async def _read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body  # the usual case: one message, no copy
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        parts.append(message.get("body", b""))
    return b"".join(parts)


@contextlib.asynccontextmanager
async def _cancelled_when_client_leaves(receive: Receive) -> AsyncIterator[None]:
    """Cancels the block when the client disconnects (its request body read): a held request stops
    waiting, a forwarded one closes its upstream connection (the replica stops generating)."""
    task = asyncio.current_task()
    assert task is not None
    state = {"inside": True, "left": False}

    def on_message(watcher: asyncio.Future[Message]) -> None:
        if watcher.cancelled() or watcher.exception() is not None:
            return
        if state["inside"] and watcher.result()["type"] == "http.disconnect":
            state["left"] = True
            task.cancel()

    watcher = asyncio.ensure_future(receive())
    watcher.add_done_callback(on_message)
    try:
        yield
    except asyncio.CancelledError:
        if not state["left"]:
            raise
        task.uncancel()  # the client is gone: nothing to answer
    finally:
        state["inside"] = False
        watcher.cancel()


def _rest_app(
    router: Router, lifespan: Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]
) -> FastAPI:
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

    return app


def _unknown_model(model: str) -> APIError:
    return APIError(404, f"The model {echoed(model)} does not exist; see /v1/models.", param="model",
                    code="model_not_found")  # fmt: skip
