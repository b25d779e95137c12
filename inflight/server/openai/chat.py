"""POST /v1/chat/completions: messages rendered with the model's chat template; JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from inflight.engine.sequence import PositionLogprobs
from inflight.server.context import Context, ServerContext
from inflight.server.errors import bad_request, not_supported
from inflight.server.openai.common import (
    GENERATION_RESPONSES,
    RunState,
    chat_prompt,
    check_prompts,
    check_sampling,
    chunk_usage,
    include_usage,
    respond,
    sampling_params,
    sse,
    start_run,
    token_text,
)
from inflight.server.openai.grammar import check_request_grammar
from inflight.server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    now,
)

router = APIRouter(tags=["openai"])


def _logprobs(
    ctx: ServerContext, token_ids: list[int], positions: list[PositionLogprobs], top_n: int
) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        text = token_text(ctx, token_id, chosen)
        top = [
            TopLogprob(
                token=token_text(ctx, tid, lp),
                logprob=lp.logprob,
                bytes=list(token_text(ctx, tid, lp).encode()),
            )
            for tid, lp in sorted(position.items(), key=lambda item: item[1].rank)
            if lp.rank <= top_n
        ][:top_n]
        content.append(
            TokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def _check_unsupported_features(body: ChatCompletionRequest) -> None:
    """Tool calling is not implemented: say so instead of ignoring it."""
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise not_supported(f"{name} (tool calling) is not supported by this server; leave it out.", name)
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise not_supported(f"{name} (tool calling) is not supported by this server; leave it out.", name)


@dataclass
class _Chat:
    """One submitted /v1/chat/completions request: its choices as JSON or as SSE chunks."""

    ctx: ServerContext
    body: ChatCompletionRequest
    run: RunState
    created: int = field(default_factory=now)

    def logprobs(self, tokens: list[int], positions: list[PositionLogprobs]) -> ChatLogprobs | None:
        top_n = self.body.top_logprobs or 0
        return _logprobs(self.ctx, tokens, positions, top_n) if self.body.logprobs else None

    def chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        model = self.ctx.settings.served_model_name
        return ChatCompletionChunk(
            id=self.run.request_id, created=self.created, model=model, choices=choices, usage=usage
        )

    async def chunks(self) -> AsyncIterator[str]:
        """A role-only first chunk per choice, then content deltas, then (if asked) the usage."""
        with_usage = include_usage(self.body)
        exclude = set() if with_usage else {"usage"}
        for j in range(self.body.n):
            role = ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
            yield sse(self.chunk([role], chunk_usage(self.body, self.run)).model_dump_json(exclude=exclude))
        async for choice, text, tokens, logprobs in self.run.updates():
            if not text and not tokens and choice.finish_reason is None:
                continue
            delta = ChatChunkChoice(
                index=choice.index,
                delta=DeltaMessage(content=text) if text else DeltaMessage(),
                logprobs=self.logprobs(tokens, logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            usage = chunk_usage(self.body, self.run)
            yield sse(self.chunk([delta], usage).model_dump_json(exclude=exclude))
        if with_usage:
            yield sse(self.chunk([], usage=self.run.usage()).model_dump_json())

    def json(self) -> JSONResponse:
        choices = [
            ChatChoice(
                index=index,
                message=AssistantMessage(content=choice.text),
                logprobs=self.logprobs(choice.token_ids, choice.logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for index, choice in sorted(self.run.choices.items())
        ]
        response = ChatCompletionResponse(
            id=self.run.request_id,
            created=self.created,
            model=self.ctx.settings.served_model_name,
            choices=choices,
            usage=self.run.usage(),
        )
        return JSONResponse(response.model_dump())


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    check_sampling(ctx, body)
    _check_unsupported_features(body)
    await check_request_grammar(ctx, body)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", param="top_logprobs")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true; set add_generation_prompt "
            "to false.",
            param="continue_final_message",
        )
    prompt = await ctx.off_loop(
        chat_prompt,
        ctx,
        body.messages,
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
    )
    prompt = body.truncate(prompt)
    check_prompts(ctx, [prompt], body.max_new_tokens, param="messages")
    run = start_run(ctx, request, "chatcmpl", [prompt], sampling_params(body), body.stream)
    chat = _Chat(ctx, body, run)
    return await respond(run, request, body.stream, chat.chunks, chat.json)
