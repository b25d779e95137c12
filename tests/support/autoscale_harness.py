"""The real operator for the integration tests (short autoscaling rounds) and helpers to play pods."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx

from support.emulated import running_operator as _running_operator


def running_operator(autoscale_seconds: float = 1.0) -> contextlib.AbstractAsyncContextManager[Any]:
    return _running_operator(autoscale_seconds=autoscale_seconds, scrape_timeout_seconds=1.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def background(coroutine: Any) -> AsyncIterator[None]:
    task = asyncio.create_task(coroutine)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])


async def server_ready(http: httpx.AsyncClient, port: int) -> bool:
    """The readiness probe: GET /ready on the pod's server port."""
    with contextlib.suppress(httpx.HTTPError):
        return (await http.get(f"http://127.0.0.1:{port}/ready", timeout=1)).status_code == 200
    return False
