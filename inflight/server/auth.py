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


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    given = credentials.credentials if credentials is not None else ""
    # HTTP header values arrive as bytes decoded as latin-1: compare bytes, the key as UTF-8.
    if not given or not hmac.compare_digest(given.encode("latin-1"), expected.encode("utf-8")):
        message = (
            "Missing API key: send 'Authorization: Bearer <key>'."
            if not given
            else "Incorrect API key provided."
        )
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
