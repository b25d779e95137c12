"""What every route needs: the server's settings and engine, kept on `app.state.ctx`, and the one
FastAPI dependency (`Context`) that hands it to a route.

Route modules import this module, never `app.py`: the app imports the routes, not the other way round.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from inflight.engine.async_engine import AsyncEngine
from inflight.server.limits import DEFAULT_MAX_BODY_BYTES
from inflight.server.metrics import ServerMetrics
from inflight.server.response_store import ResponseStore
from inflight.server.tool_parsers import ParserChoice

T = TypeVar("T")

TOKENIZER_THREADS = 2


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tool_call_parser: ParserChoice = "auto"  # how "auto" tool calls are read from the output


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
    # /v1/responses kept for previous_response_id (in memory, this process only).
    responses: ResponseStore = field(default_factory=ResponseStore)

    async def off_loop(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a tokenizer call, or the building of an answer, in the tokenizer threads, not on the event
        loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, partial(function, *args, **kwargs))


async def get_context(request: Request) -> ServerContext:
    """A FastAPI dependency (async, so FastAPI does not hop to a worker thread for it)."""
    ctx: ServerContext = request.app.state.ctx
    return ctx


Context = Annotated[ServerContext, Depends(get_context)]
