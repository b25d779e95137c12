"""One JSON line per HTTP request on the `inflight.access` logger: method, path, status, latency, tokens.

Never the prompt or the completion text. Handlers put token counts in `request.state.usage`.
"""

from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("inflight.access")


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state: dict[str, object] = scope.setdefault("state", {})
        status = 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            record: dict[str, object] = {
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "latency_ms": round((time.perf_counter() - started) * 1000, 2),
            }
            usage = state.get("usage")
            if isinstance(usage, dict):
                record.update(usage)
            if "request_id" in state:
                record["request_id"] = state["request_id"]
            client = scope.get("client")
            if client:
                record["client"] = client[0]
            access_logger.info(json.dumps(record))
