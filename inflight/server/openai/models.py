"""GET /v1/models and /v1/models/{model}: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter

from inflight.openai_errors import error_responses
from inflight.server.context import Context, ServerContext
from inflight.server.openai.common import check_model
from inflight.server.openai.protocol import ModelCard, ModelList

router = APIRouter(tags=["openai"])


def model_card(ctx: ServerContext) -> ModelCard:
    return ModelCard(
        id=ctx.settings.served_model_name,
        created=ctx.engine.started_at,
        max_model_len=ctx.engine.max_model_len,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: Context) -> ModelList:
    return ModelList(data=[model_card(ctx)])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(404))
async def get_model(model: str, ctx: Context) -> ModelCard:
    check_model(ctx, model, status=404)
    return model_card(ctx)
