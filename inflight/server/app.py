"""The FastAPI app factory: `create_app(engine, settings)` wires routes, auth, errors, metrics and logging.

The app imports every router; no router imports the app (they share `context.py`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Security

from inflight import __version__
from inflight.engine.async_engine import AsyncEngine, EngineUnavailableError
from inflight.openai_errors import error_responses, install_error_handlers
from inflight.server.access_log import AccessLogMiddleware
from inflight.server.auth import API_KEY, ApiKeyMiddleware, needs_api_key
from inflight.server.context import ServerContext, ServerSettings
from inflight.server.demo import demo_router
from inflight.server.docs import docs_router
from inflight.server.metrics import ResponseCountingMiddleware, ServerMetrics
from inflight.server.openai import chat, completions, models, responses, tokens
from inflight.server.routes import info_router, probe_router, require_serving
from inflight.server.transport import BodySizeLimitMiddleware

logger = logging.getLogger("inflight.server")

# Behind the API key (when set) and answered only while the engine serves (else 503).
MODEL_ROUTERS = (info_router, models.router, completions.router, chat.router, responses.router, tokens.router)
# What ApiKeyMiddleware guards: the model routes and the routes that declare the key themselves.
KEYED_ROUTES = [
    *(route for router in MODEL_ROUTERS for route in router.routes),
    *(route for route in demo_router.routes if needs_api_key(route)),
]


def model_loaded(engine: AsyncEngine) -> bool:
    """Whether the engine thread finished loading the model (False while loading or if it failed)."""
    try:
        engine.engine  # noqa: B018 (raises while the model loads)
    except EngineUnavailableError:
        return False
    return True


def engine_info(engine: AsyncEngine) -> dict[str, str]:
    """The loaded engine's resolved settings for `inflight:engine_info` ({} while the model loads)."""
    try:
        loaded = engine.engine
    except EngineUnavailableError:
        return {}
    return {
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(loaded.kv_dtype).removeprefix("torch."),
        "tensor_parallel_size": str(loaded.config.tensor_parallel_size),
    }


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; the engine thread starts (load + warm-up) with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(application: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            loading = not model_loaded(engine)
            await engine.drain(timeout=0)
            if loading:
                # The load runs in a daemon thread that cannot be interrupted (reading weights): leave it.
                logger.warning("stopping while the model is still loading; not waiting for the load")
            else:
                await engine.stop()
            application.state.ctx.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="inflight",
        version=__version__,
        summary="OpenAI-compatible LLM server with continuous batching over a paged KV cache.",
        lifespan=lifespan,
        docs_url=None,  # docs.py serves /docs without a CDN
        redoc_url=None,  # ReDoc has no offline bundle here; /docs covers the same schema
    )
    metrics = ServerMetrics(engine.stats, lambda: engine_info(engine))
    app.state.ctx = ServerContext(engine=engine, settings=settings, metrics=metrics)
    app.state.api_key = settings.api_key
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, routes=KEYED_ROUTES)
    app.add_middleware(ResponseCountingMiddleware, metrics=metrics)
    app.add_middleware(AccessLogMiddleware)
    app.include_router(probe_router)
    for router in MODEL_ROUTERS:
        app.include_router(
            router,
            dependencies=[Security(API_KEY), Depends(require_serving)],
            responses=error_responses(400, 401, 503),
        )
    app.include_router(demo_router)
    app.include_router(docs_router)
    return app
