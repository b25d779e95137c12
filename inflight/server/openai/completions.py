"""POST /v1/completions: prompts as text or token ids, echo, logprobs with text offsets; JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from inflight.engine.sequence import PositionLogprobs
from inflight.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from inflight.openai_errors import bad_request
from inflight.server.context import Context, ServerContext
from inflight.server.openai.common import (
    GENERATION_RESPONSES,
    ChoiceState,
    RunState,
    answer_json,
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
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    now,
)

router = APIRouter(tags=["openai"])

# With echo and logprobs every choice repeats its prompt's logprobs: at most this many entries (prompt
# tokens x n x (logprobs + 1), over all prompts) per request. 1024 tokens x n=48 x 21 is ~27 MB of JSON.
MAX_PROMPT_LOGPROBS = 2**20


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


def _check_prompt_logprobs(body: CompletionRequest, prompts: list[list[int]]) -> None:
    """A 400 when the echoed prompts' logprobs would pass MAX_PROMPT_LOGPROBS."""
    if not body.echo or body.logprobs is None:
        return
    entries = sum(len(ids) for ids in prompts) * body.n * (body.logprobs + 1)
    if entries > MAX_PROMPT_LOGPROBS:
        raise bad_request(
            f"echo with logprobs returns prompt tokens x n x (logprobs + 1) = {entries:,} logprob entries; "
            f"this server's limit is {MAX_PROMPT_LOGPROBS:,} per request: lower n or logprobs, or send "
            "fewer or shorter prompts.",
            param="n" if body.n > 1 else "logprobs",
            code="too_many_logprobs",
        )


def _prompts(ctx: ServerContext, body: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
    """Token ids (truncated as the request asks) and, for untruncated text prompts, the text of each
    prompt in a completions request."""
    ids, texts = _tokenized(ctx.engine.tokenizer, body.prompt, body.add_special_tokens)
    truncated = [body.truncate(p) for p in ids]
    return truncated, [t if len(p) == len(q) else None for t, p, q in zip(texts, truncated, ids, strict=True)]


def _tokenized(tokenizer: Tokenizer, prompt: Any, special: bool) -> tuple[list[list[int]], list[str | None]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, special)], [prompt]
    if not prompt:
        raise bad_request("The prompt list is empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)], [None]
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p, special) for p in prompt], list(prompt)
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


@dataclass
class _Completion:
    """One submitted /v1/completions request: its choices as JSON or as SSE chunks."""

    ctx: ServerContext
    body: CompletionRequest
    run: RunState
    prompt_texts: list[str | None]
    created: int = field(default_factory=now)
    # choice index -> offsets of its generated tokens
    generated_offsets: dict[int, TextOffsets] = field(default_factory=dict)
    # prompt index -> its tokens' logprobs, made once for the n choices that echo it
    echoed_logprobs: dict[int, CompletionLogprobs] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.ctx.engine.tokenizer

    def response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        model = self.ctx.settings.served_model_name
        return CompletionResponse(
            id=self.run.request_id, created=self.created, model=model, choices=choices, usage=usage
        )

    def echo_text(self, prompt_index: int) -> str:
        text = self.prompt_texts[prompt_index]
        return text if text is not None else self.tokenizer.decode(self.run.prompts[prompt_index])

    def choice(
        self,
        choice: ChoiceState,
        text: str,
        tokens: list[int],
        positions: Sequence[PositionLogprobs | None],
        first: bool,
    ) -> CompletionChoice:
        """`first`: the choice's first (or only) answer, which carries the echoed prompt."""
        echo = first and self.body.echo
        return CompletionChoice(
            index=choice.index,
            text=(self.echo_text(choice.prompt_index) if echo else "") + text,
            logprobs=None if self.body.logprobs is None else self.logprobs(choice, tokens, positions, echo),
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )

    def logprobs(
        self,
        choice: ChoiceState,
        tokens: list[int],
        positions: Sequence[PositionLogprobs | None],
        with_prompt: bool,
    ) -> CompletionLogprobs:
        top_n = self.body.logprobs or 0
        prompt_ids = self.run.prompts[choice.prompt_index]
        if choice.index not in self.generated_offsets:
            start = len(self.echo_text(choice.prompt_index)) if self.body.echo else 0
            self.generated_offsets[choice.index] = TextOffsets(self.tokenizer, prompt_ids, start)
        step = _logprobs(self.ctx, tokens, positions, top_n, self.generated_offsets[choice.index])
        if not with_prompt:
            return step
        prompt = self.prompt_logprobs(choice.prompt_index)
        return CompletionLogprobs(
            tokens=prompt.tokens + step.tokens,
            token_logprobs=prompt.token_logprobs + step.token_logprobs,
            top_logprobs=prompt.top_logprobs + step.top_logprobs,
            text_offset=prompt.text_offset + step.text_offset,
        )

    def prompt_logprobs(self, prompt_index: int) -> CompletionLogprobs:
        """The logprobs of a prompt's tokens (made once; every choice of the prompt echoes them)."""
        if prompt_index not in self.echoed_logprobs:
            prompt_ids = self.run.prompts[prompt_index]
            positions = self.run.prompt_logprobs.get(prompt_index) or [None] * len(prompt_ids)
            self.echoed_logprobs[prompt_index] = _logprobs(
                self.ctx, prompt_ids, positions, self.body.logprobs or 0, TextOffsets(self.tokenizer, (), 0)
            )
        return self.echoed_logprobs[prompt_index]

    async def chunks(self) -> AsyncIterator[str]:
        with_usage = include_usage(self.body)
        started: set[int] = set()  # choices that sent their first chunk
        async for choice, text, tokens, logprobs in self.run.updates():
            first = choice.index not in started
            if not (first or text or tokens or choice.finish_reason):
                continue
            started.add(choice.index)
            usage = chunk_usage(self.body, self.run)
            chunk = self.response([self.choice(choice, text, tokens, logprobs, first)], usage=usage)
            yield sse(chunk.model_dump_json(exclude=None if with_usage else {"usage"}))
        if with_usage:
            yield sse(self.response([], usage=self.run.usage()).model_dump_json())

    def json(self) -> bytes:
        choices = [
            self.choice(choice, choice.text, choice.token_ids, choice.logprobs, first=True)
            for _, choice in sorted(self.run.choices.items())
        ]
        return answer_json(self.response(choices, usage=self.run.usage()))


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    check_sampling(ctx, body)
    if body.suffix is not None:
        raise bad_request("suffix is not supported; leave it out.", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is only supported equal to n.", param="best_of")
    _check_fits(ctx, len(body.prompt) if _is_prompt_list(body.prompt) else 1, body.n)
    await check_request_grammar(ctx, body)
    prompts, prompt_texts = await ctx.off_loop(_prompts, ctx, body)
    check_prompts(ctx, prompts, body.max_tokens, param="prompt")
    _check_prompt_logprobs(body, prompts)
    field = next((name for name, _ in body.guided_requests()), None)
    run = start_run(ctx, request, "cmpl", prompts, sampling_params(body), body.stream, field)
    completion = _Completion(ctx, body, run, prompt_texts)
    return await respond(run, request, body.stream, completion.chunks, completion.json)
