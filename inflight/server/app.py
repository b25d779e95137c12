"""The FastAPI app factory: `create_app(engine, settings)` wires routes, auth, errors, metrics and logging."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request

from inflight import __version__
from inflight.engine.async_engine import AsyncEngine, EngineUnavailableError
from inflight.server.access_log import AccessLogMiddleware
from inflight.server.errors import install_error_handlers
from inflight.server.limits import DEFAULT_MAX_BODY_BYTES
from inflight.server.metrics import ResponseCountingMiddleware, ServerMetrics
from inflight.server.transport import BodySizeLimitMiddleware

logger = logging.getLogger("inflight.server")
T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


TOKENIZER_THREADS = 2


def tokenizer_pool() -> ThreadPoolExecutor:
    """Worker threads for tokenizing and detokenizing requests, started now: a thread started on the
    request path can stall the event loop (Thread.start waits for the new thread, which is already
    inside a long encode)."""
    pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="inflight-tokenize")
    started = threading.Barrier(TOKENIZER_THREADS)
    for future in [pool.submit(started.wait) for _ in range(TOKENIZER_THREADS)]:
        future.result()
    return pool


@dataclass
class ServerContext:
    """What every route needs, kept on `app.state.ctx`."""

    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    tokenizer_pool: ThreadPoolExecutor = field(default_factory=tokenizer_pool)

    async def off_loop(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a tokenizer call in the tokenizer threads, not on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, partial(function, *args, **kwargs))


async def get_context(request: Request) -> ServerContext:
    """A FastAPI dependency (async, so FastAPI does not hop to a worker thread for it)."""
    ctx: ServerContext = request.app.state.ctx
    return ctx


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
        "tensor_parallel_size": str(loaded.config.tensor_parallel_size),
    }


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; the engine thread starts (load + warm-up) with the app's lifespan."""
    from inflight.server.demo import demo_router
    from inflight.server.docs import docs_router
    from inflight.server.routes import api_router, probe_router

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
    app.add_middleware(ResponseCountingMiddleware, metrics=metrics)
    app.add_middleware(AccessLogMiddleware)
    app.include_router(probe_router)
    app.include_router(api_router)
    app.include_router(demo_router)
    app.include_router(docs_router)
    return app
