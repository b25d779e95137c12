"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure the server answers is an `APIError`; FastAPI's own validation (422) and routing (404/405)
errors are rendered the same way, so a client mistake is never a 500 or a stack trace.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("inflight.server")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; only the access log sees it

_TYPE_BY_STATUS = {
    400: INVALID_REQUEST,
    401: AUTHENTICATION,
    404: NOT_FOUND,
    405: INVALID_REQUEST,
    408: INVALID_REQUEST,
    413: INVALID_REQUEST,
    415: INVALID_REQUEST,
    429: RATE_LIMIT,
    503: UNAVAILABLE,
}


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = _TYPE_BY_STATUS.get(status, SERVER_ERROR)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for the given error statuses (for the docs and the schema fuzzer)."""
    return {status: {"model": ErrorResponse} for status in statuses}


MAX_ECHOED_CHARS = 100


def echoed(value: str) -> str:
    """A client's value quoted for an error message, cut to MAX_ECHOED_CHARS characters (a wrong model
    name may be a megabyte)."""
    if len(value) <= MAX_ECHOED_CHARS:
        return repr(value)
    return f"{value[:MAX_ECHOED_CHARS]!r}... ({len(value)} characters)"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="not_supported")


def _location(loc: Sequence[int | str]) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _common_prefix(locations: list[tuple[int | str, ...]]) -> tuple[int | str, ...]:
    prefix = locations[0]
    for loc in locations[1:]:
        size = 0
        while size < min(len(prefix), len(loc)) and prefix[size] == loc[size]:
            size += 1
        prefix = prefix[:size]
    return prefix


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type names JSON (as FastAPI decides whether to parse the body as JSON)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """`content_type`: the request's header (None: absent; FastAPI then parses the body as JSON)."""
    errors = exc.errors()
    if not errors:
        return bad_request("The request body is invalid.", code="invalid_body")
    if (
        content_type is not None
        and not _is_json(content_type)
        and any(e.get("loc") == ("body",) for e in errors)
    ):
        return bad_request(
            f"The request body was sent as {content_type!r}; send JSON with 'Content-Type: application/json' "
            "(curl: -H 'Content-Type: application/json').",
            code="invalid_content_type",
        )
    if any(error.get("type") == "json_invalid" for error in errors):
        return bad_request("The request body is not valid JSON.", code="invalid_json")
    locations = [tuple(error.get("loc", ())) for error in errors]
    messages = list(dict.fromkeys(str(error.get("msg", "invalid value")) for error in errors))
    common = _location(_common_prefix(locations))
    if len(errors) > 1 and common:
        # Every alternative of one union-typed field failed: name the field, not pydantic's variant tags.
        return bad_request(f"{common}: invalid value ({'; '.join(messages[:3])})", param=common)
    parts = []
    for loc, error in zip(locations[:5], errors[:5], strict=True):
        where = _location(loc)
        text = str(error.get("msg", "invalid value"))
        parts.append(f"{where}: {text}" if where else text)
    first = _location(locations[0])
    if not first:
        return bad_request("; ".join(parts), code="invalid_body")
    return bad_request("; ".join(parts), param=first)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc, request.headers.get("content-type")).response()

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            message = "Not found: no such endpoint. See /docs for the API."
        error = APIError(exc.status_code, message, code="body_too_large" if exc.status_code == 413 else None)
        error.headers = dict(exc.headers or {})
        return error.response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "Internal server error; the server log has the details.").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
