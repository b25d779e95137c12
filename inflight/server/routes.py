"""Probes and /metrics (open), /version, and `require_serving`: the guard the app puts, with the API key,
in front of every model route."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from inflight import __version__
from inflight.openai_errors import APIError
from inflight.server.context import Context


class HealthResponse(BaseModel):
    status: str
    detail: str | None = None


class VersionResponse(BaseModel):
    version: str


probe_router = APIRouter(tags=["probes"])


@probe_router.get(
    "/health",
    response_model=HealthResponse,
    responses={503: {"model": HealthResponse}},
    summary="Liveness: 200 unless the engine has failed",
)
async def health(ctx: Context) -> JSONResponse:
    engine = ctx.engine
    if engine.state == "failed":
        return JSONResponse({"status": "failed", "detail": str(engine.error)}, status_code=503)
    return JSONResponse({"status": "ok", "detail": engine.state})


@probe_router.get(
    "/ready",
    response_model=HealthResponse,
    responses={503: {"model": HealthResponse}},
    summary="Readiness: 200 once the model is loaded and warmed up, 503 while loading or draining",
)
async def ready(ctx: Context) -> JSONResponse:
    state = ctx.engine.state
    return JSONResponse({"status": state, "detail": None}, status_code=200 if state == "ready" else 503)


@probe_router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(ctx: Context) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def require_serving(ctx: Context) -> None:
    """503 while the model loads, after it failed, or once the server is draining for shutdown."""
    state = ctx.engine.state
    if state == "ready":
        return
    if state == "loading":
        raise APIError(503, "The model is still loading; retry shortly.", headers={"Retry-After": "5"})
    if state == "failed":
        raise APIError(503, f"The engine failed: {ctx.engine.error}")
    raise APIError(503, "The server is shutting down; retry on another replica.", code="shutting_down")


info_router = APIRouter(tags=["info"])


@info_router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)
