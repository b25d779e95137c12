"""HTTP routes. Probes and /metrics are open; everything else sits behind the API key (when one is set)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from inflight import __version__
from inflight.server import serving
from inflight.server.app import ServerContext, get_context
from inflight.server.auth import require_api_key
from inflight.server.errors import APIError
from inflight.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    error_responses,
)

Context = Annotated[ServerContext, Depends(get_context)]

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


api_router = APIRouter(
    dependencies=[Depends(require_api_key), Depends(require_serving)],
    responses=error_responses(400, 401, 503),
)


@api_router.get("/version", response_model=VersionResponse, tags=["info"])
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


@api_router.get("/v1/models", response_model=ModelList, tags=["openai"])
async def list_models(ctx: Context) -> ModelList:
    return ModelList(data=[serving.model_card(ctx)])


@api_router.get(
    "/v1/models/{model:path}", response_model=ModelCard, tags=["openai"], responses=error_responses(404)
)
async def get_model(model: str, ctx: Context) -> ModelCard:
    if model != ctx.settings.served_model_name:
        raise APIError(
            404, f"The model {model!r} does not exist here; see /v1/models.", code="model_not_found"
        )
    return serving.model_card(ctx)


@api_router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    tags=["openai"],
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"},
        **error_responses(429, 500),
    },
)
async def create_completion(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    return await serving.completion(ctx, body, request)


@api_router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    tags=["openai"],
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"},
        **error_responses(429, 500),
    },
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    return await serving.chat_completion(ctx, body, request)


@api_router.post("/tokenize", response_model=TokenizeResponse, tags=["tokens"])
async def tokenize(body: TokenizeRequest, ctx: Context) -> TokenizeResponse:
    return await serving.tokenize(ctx, body)


@api_router.post("/detokenize", response_model=DetokenizeResponse, tags=["tokens"])
async def detokenize(body: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    return await serving.detokenize(ctx, body)
