"""The FastAPI app factory: `create_app(engine, settings)` wires routes, auth, errors, metrics and logging."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request

from inflight import __version__
from inflight.engine.async_engine import AsyncEngine
from inflight.server.access_log import AccessLogMiddleware
from inflight.server.errors import install_error_handlers
from inflight.server.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from inflight.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass
class ServerContext:
    """What every route needs, kept on `app.state.ctx`."""

    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics


async def get_context(request: Request) -> ServerContext:
    """A FastAPI dependency (async, so FastAPI does not hop to a worker thread for it)."""
    ctx: ServerContext = request.app.state.ctx
    return ctx


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; the engine thread starts (load + warm-up) with the app's lifespan."""
    from inflight.server.demo import demo_router
    from inflight.server.routes import api_router, probe_router

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.drain(timeout=0)
            await engine.stop()

    app = FastAPI(
        title="inflight",
        version=__version__,
        summary="OpenAI-compatible LLM server with continuous batching over a paged KV cache.",
        lifespan=lifespan,
    )
    app.state.ctx = ServerContext(engine=engine, settings=settings, metrics=ServerMetrics(engine.stats))
    app.state.api_key = settings.api_key
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(AccessLogMiddleware)
    app.include_router(probe_router)
    app.include_router(api_router)
    app.include_router(demo_router)
    return app
