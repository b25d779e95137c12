"""Enforces limits.py: the request-body middleware (413; a body that never completes is answered as what
ended it, 408 or 499) and uvicorn's protocol with a connection cap and header/body read deadlines (408)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inflight.openai_errors import CLIENT_CLOSED_REQUEST, APIError
from inflight.server.limits import ConnectionLimits

logger = logging.getLogger("inflight.server")


def body_too_large(max_body_bytes: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {max_body_bytes} bytes "
        "(inflight serve --max-body-bytes); send a smaller request.",
        code="body_too_large",
    )


# Put in a request's ASGI scope by the protocol when it closes the connection before the body arrived
# (the status it answered, 408); a body cut off without it was closed by the client or evicted (499).
CLOSED_WITH_STATUS = "inflight.closed_with_status"


class BodySizeLimitMiddleware:
    """413 for a request body over `max_body_bytes`, before the app parses it; a body whose connection
    closed before it was complete is answered (to nobody, but counted and logged) with the status that
    ended it: 408 at the body timeout, else 499 (client closed, or evicted by the connection cap). Left
    to FastAPI it would be a 400 "error parsing the body"."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = body_too_large(self.max_body_bytes)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await error.response()(scope, receive, send)
                return
        received = 0
        complete = False

        async def limited_receive() -> Message:
            nonlocal received, complete
            message = await receive()
            # An HTTPException passes FastAPI's body parsing unchanged; errors.py renders it.
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise StarletteHTTPException(413, error.message)
            elif message["type"] == "http.disconnect" and not complete:
                status = scope.get(CLOSED_WITH_STATUS, CLIENT_CLOSED_REQUEST)
                raise StarletteHTTPException(status, "The connection closed before the request body arrived.")
            return message

        await self.app(scope, limited_receive, send)


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection (sent outside any ASGI cycle)."""
    body = json.dumps(APIError(status, message, code="request_timeout").body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


EVICTION_LOG_INTERVAL = 10.0  # seconds; at most one eviction WARNING per interval


class EvictionWarnings:
    """The connection cap's WARNING, at most one line per `interval` seconds (a flood of connections
    evicts hundreds a second): the first eviction is logged at once, the ones after it are counted and
    logged as one line when the interval ends."""

    def __init__(self, max_connections: int, interval: float = EVICTION_LOG_INTERVAL) -> None:
        self.max_connections = max_connections
        self.interval = interval
        self._unlogged = 0
        self._interval_end: asyncio.TimerHandle | None = None

    def evicted(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._interval_end is None:
            logger.warning(
                "more than %d open connections (--max-connections): closing the oldest idle one",
                self.max_connections,
            )
            self._interval_end = loop.call_later(self.interval, self._end_interval, loop)
        else:
            self._unlogged += 1

    def _end_interval(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._unlogged:
            self._interval_end = None
            return
        logger.warning(
            "more than %d open connections (--max-connections): closed %d more in the last %gs",
            self.max_connections,
            self._unlogged,
            self.interval,
        )
        self._unlogged = 0
        self._interval_end = loop.call_later(self.interval, self._end_interval, loop)


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a connection cap and header/body read deadlines."""
    warnings = EvictionWarnings(limits.max_connections)
    # The order connections were made in, for evicting the oldest: not the loop's clock, which uvloop reads
    # once per iteration in whole milliseconds, so connections made within one millisecond tie.
    opened = itertools.count()

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._opened = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._opened = next(opened)
            if len(self.connections) > limits.max_connections:
                self._evict_one()
            self._arm(limits.header_timeout, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:
                self._arm(limits.header_timeout, "headers")

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            if self.cycle is not None and self.cycle.more_body:
                self._arm(limits.body_timeout, "body")

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _busy(self) -> bool:
            """A request of this connection is being answered (its headers arrived, no response yet)."""
            return self.cycle is not None and not self.cycle.response_complete and self._deadline is None

        def _evict_one(self) -> None:
            idle = [c for c in self.connections if isinstance(c, GuardedHttpToolsProtocol) and not c._busy()]
            victim = min(idle, key=lambda c: c._opened) if idle else self
            warnings.evicted(self.loop)
            victim.transport.close()
            victim.connections.discard(victim)

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._timed_out, what, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self, what: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                flag = "--header-timeout" if what == "headers" else "--body-timeout"
                message = f"The request {what} did not arrive within {seconds:g} s ({flag}); closing."
                self.transport.write(_raw_error(408, "Request Timeout", message))
                if self.cycle is not None:
                    self.cycle.scope[CLOSED_WITH_STATUS] = 408  # type: ignore[literal-required]
            self.transport.close()

    return GuardedHttpToolsProtocol
