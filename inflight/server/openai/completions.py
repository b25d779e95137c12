"""POST /v1/completions: prompts as text or token ids, echo, logprobs with text offsets; JSON or SSE."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from inflight.engine.sequence import PositionLogprobs
from inflight.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from inflight.server.context import Context, ServerContext
from inflight.server.errors import bad_request, error_responses
from inflight.server.openai.common import (
    CLIENT_CLOSED_REQUEST,
    ChoiceState,
    RunState,
    check_prompts,
    check_sampling,
    collect,
    include_usage,
    sampling_params,
    sse,
    sse_stream,
    submit,
    token_text,
)
from inflight.server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now,
)

router = APIRouter(tags=["openai"])


def _is_prompt_list(prompt: Any) -> bool:
    """Several prompts (texts or token-id lists), as opposed to one text or one list of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _check_fits(ctx: ServerContext, num_prompts: int, n: int) -> None:
    """A request needing more sequences than the server ever holds is a 400 (a 429 would be retried)."""
    capacity = ctx.engine.max_slots + ctx.engine.max_queue
    if num_prompts * n > capacity:
        raise bad_request(
            f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences, but this server holds at most "
            f"{capacity} ({ctx.engine.max_slots} slots + {ctx.engine.max_queue} queued); "
            "send fewer prompts per request or lower n.",
            param="prompt" if n == 1 else "n",
        )


def _prompts(ctx: ServerContext, prompt: Any) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and (for text prompts) the text of each prompt in a completions request."""
    tokenizer = ctx.engine.tokenizer
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)], [prompt]
    if not prompt:
        raise bad_request("The prompt list is empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)], [None]
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt], list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt], [None] * len(prompt)
    raise bad_request("prompt must be a string, a list of strings, or token ids.", param="prompt")


class TextOffsets:
    """Character offsets of successive tokens in the text they decode to (for `text_offset`)."""

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int], start: int) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, context_ids)
        self.offset = start

    def advance(self, token_id: int) -> int:
        """The offset where `token_id` starts; moves past its text."""
        at = self.offset
        self.offset += len(self._detokenizer.add(token_id))
        return at


def _logprobs(
    ctx: ServerContext,
    token_ids: list[int],
    positions: Sequence[PositionLogprobs | None],
    top_n: int,
    offsets: TextOffsets,
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position else None
        result.tokens.append(token_text(ctx, token_id, chosen))
        result.token_logprobs.append(chosen.logprob if chosen else None)
        result.text_offset.append(offsets.advance(token_id))
        if position is None:
            result.top_logprobs.append(None)
            continue
        top = {
            token_text(ctx, tid, lp): lp.logprob
            for tid, lp in sorted(position.items(), key=lambda item: item[1].rank)
            if lp.rank <= top_n or tid == token_id
        }
        result.top_logprobs.append(top)
    return result


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"},
        **error_responses(429, 500),
    },
)
async def create_completion(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    check_sampling(ctx, body)
    if body.suffix is not None:
        raise bad_request("suffix is not supported; leave it out.", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is only supported equal to n.", param="best_of")
    _check_fits(ctx, len(body.prompt) if _is_prompt_list(body.prompt) else 1, body.n)
    prompts, prompt_texts = await ctx.off_loop(_prompts, ctx, body.prompt)
    check_prompts(ctx, prompts, body.max_tokens, param="prompt")
    params = sampling_params(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    run = RunState(
        ctx, submit(ctx, request_id, prompts, params), body.n, prompts, keep_outputs=not body.stream
    )
    created = now()
    model = ctx.settings.served_model_name
    tokenizer = ctx.engine.tokenizer

    def echo_text(prompt_index: int) -> str:
        text = prompt_texts[prompt_index]
        return text if text is not None else tokenizer.decode(prompts[prompt_index])

    generated_offsets: dict[int, TextOffsets] = {}  # choice index -> offsets of its generated tokens

    def choice_logprobs(
        choice: ChoiceState,
        tokens: list[int],
        positions: Sequence[PositionLogprobs | None],
        with_prompt: bool,
    ) -> CompletionLogprobs:
        top_n = body.logprobs or 0
        prompt_ids = prompts[choice.prompt_index]
        result = CompletionLogprobs()
        if with_prompt:
            prompt_positions = run.prompt_logprobs.get(choice.prompt_index) or [None] * len(prompt_ids)
            result = _logprobs(ctx, prompt_ids, prompt_positions, top_n, TextOffsets(tokenizer, (), 0))
        if choice.index not in generated_offsets:
            start = len(echo_text(choice.prompt_index)) if body.echo else 0
            generated_offsets[choice.index] = TextOffsets(tokenizer, prompt_ids, start)
        step = _logprobs(ctx, tokens, positions, top_n, generated_offsets[choice.index])
        result.tokens += step.tokens
        result.token_logprobs += step.token_logprobs
        result.top_logprobs += step.top_logprobs
        result.text_offset += step.text_offset
        return result

    if body.stream:
        with_usage = include_usage(body)

        async def chunks() -> AsyncIterator[str]:
            started: set[int] = set()  # choices that sent their first chunk
            async for choice, text, tokens, logprobs in run.updates():
                first = choice.index not in started
                if not (first or text or tokens or choice.finish_reason):
                    continue
                started.add(choice.index)
                prefix = echo_text(choice.prompt_index) if first and body.echo else ""
                chunk = CompletionResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[
                        CompletionChoice(
                            index=choice.index,
                            text=prefix + text,
                            logprobs=None
                            if body.logprobs is None
                            else choice_logprobs(choice, tokens, logprobs, first and body.echo),
                            finish_reason=choice.finish_reason,
                            stop_reason=choice.stop_reason,
                        )
                    ],
                )
                yield sse(chunk.model_dump_json(exclude=None if with_usage else {"usage"}))
            if with_usage:
                final = CompletionResponse(
                    id=request_id, created=created, model=model, choices=[], usage=run.usage()
                )
                yield sse(final.model_dump_json())

        return sse_stream(run, request, chunks)

    if not await collect(run, request):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = []
    for index, choice in sorted(run.choices.items()):
        prefix = echo_text(choice.prompt_index) if body.echo else ""
        choices.append(
            CompletionChoice(
                index=index,
                text=prefix + choice.text,
                logprobs=None
                if body.logprobs is None
                else choice_logprobs(choice, choice.token_ids, choice.logprobs, body.echo),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
        )
    response = CompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=run.usage()
    )
    return JSONResponse(response.model_dump())
