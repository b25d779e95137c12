"""POST /tokenize and /detokenize (vLLM's extension of the OpenAI API): the served model's tokenizer."""

from __future__ import annotations

from fastapi import APIRouter

from inflight.openai_errors import bad_request
from inflight.server.context import Context
from inflight.server.openai.common import chat_prompt, check_in_vocabulary, check_model
from inflight.server.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from inflight.server.openai.tools import template_messages

router = APIRouter(tags=["tokens"])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, ctx: Context) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of prompt or messages.", param="prompt")
    check_model(ctx, body.model)
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages is empty.", param="messages")
        messages, _ = template_messages(body.messages, None, ctx.engine.tokenizer.chat_template)
        tokens = await ctx.off_loop(chat_prompt, ctx, messages, body.add_generation_prompt)
    else:
        assert body.prompt is not None
        tokens = await ctx.off_loop(
            ctx.engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.engine.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    check_model(ctx, body.model)
    check_in_vocabulary(ctx, body.tokens, "tokens")
    return DetokenizeResponse(prompt=await ctx.off_loop(ctx.engine.tokenizer.decode, body.tokens))
