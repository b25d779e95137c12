"""Optional API key: `Authorization: Bearer KEY`, compared in constant time. Probes and /metrics stay open."""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from inflight.server.errors import APIError

API_KEY_ENV = "INFLIGHT_API_KEY"

_bearer = HTTPBearer(auto_error=False, description="The server's API key, when it has one.")


def load_api_key(api_key_file: str | None) -> str | None:
    """The key from `api_key_file` (first line, stripped) or else $INFLIGHT_API_KEY; None = no auth."""
    if api_key_file:
        path = Path(api_key_file)
        try:
            key = path.read_text().strip()
        except OSError as error:
            raise SystemExit(f"cannot read --api-key-file {path}: {error.strerror}") from error
        if not key:
            raise SystemExit(f"--api-key-file {path} is empty; put the API key on its first line")
        return key
    return os.environ.get(API_KEY_ENV) or None


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not given or not hmac.compare_digest(given.encode(), expected.encode()):
        message = (
            "Missing API key: send 'Authorization: Bearer <key>'."
            if not given
            else "Incorrect API key provided."
        )
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
