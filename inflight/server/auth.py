"""Optional API key: `Authorization: Bearer KEY`, compared in constant time. Probes and /metrics stay open.

A route needs the key when it is declared or included with `dependencies=[Security(API_KEY)]`, which
puts the scheme in the OpenAPI schema and checks nothing itself: `ApiKeyMiddleware` checks the key for
those routes (the app lists them) before the route reads its body, so a client without the key gets 401
whatever it sent.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from pathlib import Path

from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from inflight.openai_errors import APIError

API_KEY_ENV = "INFLIGHT_API_KEY"

API_KEY = HTTPBearer(auto_error=False, description="The server's API key, when it has one.")


def load_api_key(api_key_file: str | None) -> str | None:
    """The key from `api_key_file` (its first line, stripped; UTF-8) or else $INFLIGHT_API_KEY; None =
    no auth. Later lines (a comment, a note) are ignored."""
    if api_key_file:
        path = Path(api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise SystemExit(f"cannot read --api-key-file {path}: {error.strerror}") from error
        except UnicodeDecodeError as error:
            raise SystemExit(f"--api-key-file {path} is not UTF-8 text: {error}") from error
        key = lines[0].strip() if lines else ""
        if not key:
            raise SystemExit(f"--api-key-file {path} is empty; put the API key on its first line")
        return key
    return os.environ.get(API_KEY_ENV) or None


def needs_api_key(route: BaseRoute) -> bool:
    """Whether `route` itself declared `Security(API_KEY)`."""
    return isinstance(route, APIRoute) and any(d.dependency is API_KEY for d in route.dependencies)


def authentication_error(authorization: bytes | None, expected: str) -> APIError | None:
    """The 401 for an `Authorization` header value (None: absent) that does not carry `expected`."""
    scheme, _, given = (authorization or b"").partition(b" ")
    given = given.strip() if scheme.lower() == b"bearer" else b""
    # The header arrives as bytes: compare bytes, the key as UTF-8.
    if given and hmac.compare_digest(given, expected.encode("utf-8")):
        return None
    message = (
        "Missing API key: send 'Authorization: Bearer <key>'." if not given else "Incorrect API key provided."
    )
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware:
    """401 for a request to one of `routes` without the key, before the body is read. The key is the
    app's `state.api_key` (None: no auth)."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = list(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        expected: str | None = scope["app"].state.api_key if scope["type"] == "http" else None
        if expected is None or not any(route.matches(scope)[0] != Match.NONE for route in self.routes):
            await self.app(scope, receive, send)
            return
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        error = authentication_error(authorization, expected)
        if error is None:
            await self.app(scope, receive, send)
        else:
            await error.response()(scope, receive, send)
