"""OpenAI completions and chat completions over the async engine: validation, JSON and SSE responses.

One HTTP request becomes one engine request per prompt (each with `n` sequences). Choice `i * n + j` is
sequence `j` of prompt `i`. Usage counts each prompt once and every generated token.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inflight.engine.async_engine import (
    EngineUnavailableError,
    Generation,
    GenerationRequest,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
)
from inflight.engine.sequence import Logprob, PositionLogprobs, SamplingParams
from inflight.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from inflight.server.app import ServerContext
from inflight.server.errors import APIError, bad_request, not_supported
from inflight.server.protocol import (
    MAX_STOP_SEQUENCES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    now,
)

if TYPE_CHECKING:
    from inflight.engine.engine import CompletionOutput

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; only the access log sees it


def model_card(ctx: ServerContext) -> ModelCard:
    return ModelCard(
        id=ctx.settings.served_model_name,
        created=ctx.engine.started_at,
        max_model_len=ctx.engine.max_model_len,
    )


# ---------------------------------------------------------------- validation


def _check_common(ctx: ServerContext, body: SamplingFields) -> None:
    if body.model is not None and body.model != ctx.settings.served_model_name:
        raise bad_request(
            f"The model {body.model!r} does not exist; this server serves "
            f"{ctx.settings.served_model_name!r} (see /v1/models).",
            param="model",
            code="model_not_found",
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported; leave it out.", param="logit_bias")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop takes at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}.", param="stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty.", param="stop")
    if body.n > ctx.engine.max_slots:
        raise bad_request(
            f"n={body.n} needs {body.n} slots but this server has {ctx.engine.max_slots}; lower n.", param="n"
        )
    vocab = ctx.engine.vocab_size
    bad_ids = [t for t in body.stop_token_ids or [] if t >= vocab]
    if bad_ids:
        raise bad_request(
            f"stop_token_ids {bad_ids} are outside the vocabulary (size {vocab}).", "stop_token_ids"
        )


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


def _sampling_params(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=body.cache_salt,
        )
    except ValueError as error:
        raise bad_request(str(error)) from error


def _check_lengths(ctx: ServerContext, prompts: list[list[int]], max_tokens: int | None, param: str) -> None:
    limit = ctx.engine.max_model_len
    vocab = ctx.engine.vocab_size
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    for ids in prompts:
        if not ids:
            raise bad_request("The prompt is empty; send at least one token.", param=param)
        out_of_vocab = [t for t in ids if t >= vocab]
        if out_of_vocab:
            raise bad_request(
                f"token ids {out_of_vocab[:5]} are outside the vocabulary (size {vocab}).", param=param
            )
        if len(ids) >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has {len(ids)} "
                "tokens (and at least one must be generated). Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the completion). "
                "Lower max_tokens or shorten the prompt.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        error = ctx.engine.capacity_error(len(ids), max_tokens)
        if error is not None:
            raise bad_request(error, param="max_tokens", code="context_length_exceeded")


def _is_prompt_list(prompt: Any) -> bool:
    """Several prompts (texts or token-id lists), as opposed to one text or one list of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _completion_prompts(ctx: ServerContext, prompt: Any) -> tuple[list[list[int]], list[str | None]]:
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


def _chat_prompt(
    ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    tokenizer = ctx.engine.tokenizer
    try:
        return tokenizer.encode_chat(
            [{"role": m.role, "content": m.text()} for m in messages],
            add_generation_prompt=add_generation_prompt,
        )
    except TokenizerError as error:
        raise bad_request(str(error), param="messages") from error
    except Exception as error:  # a template's raise_exception(...) or a rendering error
        raise bad_request(f"The chat template rejected the messages: {error}", param="messages") from error


# ---------------------------------------------------------------- running


def _submit(
    ctx: ServerContext, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> Generation:
    requests = [GenerationRequest(f"{request_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
    try:
        return ctx.engine.submit(requests)
    except QueueFullError as error:
        raise APIError(
            429, str(error), code="queue_full", headers={"Retry-After": str(error.retry_after)}
        ) from error
    except EngineUnavailableError as error:
        raise APIError(503, str(error), code="unavailable") from error


def _unfinished_reason(error: BaseException | None) -> str:
    """The finish reason of choices cut short: "error" when the engine failed them, else "abort"."""
    return "error" if isinstance(error, RequestFailedError) else "abort"


def _engine_error(error: Exception) -> APIError:
    if isinstance(error, RequestAbortedError):
        return APIError(503, str(error), code="shutting_down")
    return APIError(500, f"The engine failed on this request: {error}", code="engine_error")


@dataclass
class ChoiceState:
    """One choice's output so far (text and logprobs only when `keep`: the JSON path needs them, a
    stream sends each delta on and keeps counts), and its finish."""

    index: int
    prompt_index: int
    keep: bool = True
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def update(self, output: CompletionOutput) -> tuple[str, list[int], list[PositionLogprobs]]:
        """Apply an engine CompletionOutput (a delta); return its new text, tokens and logprobs."""
        logprobs = output.logprobs or []
        if self.keep:
            self.text += output.text
            self.token_ids += output.token_ids
            self.logprobs += logprobs
        self.num_tokens += len(output.token_ids)
        if output.token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if output.finish_reason is not None and self.finish_reason is None:
            self.error = output.error
            self.finish(output.finish_reason, output.stop_reason)
        return output.text, output.token_ids, logprobs

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()


@dataclass
class RunState:
    """Per-HTTP-request bookkeeping shared by the JSON and SSE paths."""

    ctx: ServerContext
    generation: Generation
    n: int
    prompts: list[list[int]]
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[PositionLogprobs | None]] = field(default_factory=dict)
    # False for streams: choices keep counts, not the text and logprobs already sent.
    keep_outputs: bool = True

    def choice(self, prompt_index: int, seq_index: int) -> ChoiceState:
        index = prompt_index * self.n + seq_index
        if index not in self.choices:
            self.choices[index] = ChoiceState(index=index, prompt_index=prompt_index, keep=self.keep_outputs)
        return self.choices[index]

    def usage(self) -> Usage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices.values())
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def close(self, reason: str) -> None:
        """Stop the generation (aborting what is unfinished); count every choice that never finished as
        finished with `reason` ("abort": the client left or the server drained; "error")."""
        self.generation.close()
        for prompt_index in range(len(self.prompts)):
            for seq_index in range(self.n):
                choice = self.choice(prompt_index, seq_index)
                if choice.finish_reason is None:
                    choice.finish(reason)
                    self.record_finish(choice)

    def record_finish(self, choice: ChoiceState) -> None:
        assert choice.finish_time is not None and choice.finish_reason is not None
        self.ctx.metrics.observe_sequence(
            arrival=self.generation.arrival_time,
            first_token=choice.first_token_time,
            finish=choice.finish_time,
            tokens=choice.num_tokens,
            reason=choice.finish_reason,
        )

    def note_usage(self, request: Request, disconnected: bool = False) -> None:
        usage = self.usage()
        request.state.usage = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            **({"disconnected": True} if disconnected else {}),
        }

    async def updates(self) -> AsyncIterator[tuple[ChoiceState, str, list[int], list[PositionLogprobs]]]:
        """Each choice's new text/tokens/logprobs as the engine produces them (several steps' worth
        merged when the consumer fell behind)."""
        async for prompt_index, output in self.generation.outputs():
            if output.prompt_logprobs is not None and prompt_index not in self.prompt_logprobs:
                self.prompt_logprobs[prompt_index] = list(output.prompt_logprobs)
            for completion in output.outputs:
                choice = self.choice(prompt_index, completion.index)
                was_finished = choice.finish_reason is not None
                text, tokens, logprobs = choice.update(completion)
                if choice.finish_reason is not None and not was_finished:
                    self.record_finish(choice)
                    if choice.finish_reason == "error":
                        raise RequestFailedError(
                            choice.error or output.error or "the engine failed this sequence"
                        )
                yield choice, text, tokens, logprobs


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(run: RunState, request: Request) -> bool:
    """Drain the generation into `run` and note its usage for the access log; False if the client went
    away first (the request is aborted)."""

    async def consume() -> None:
        async for _ in run.updates():
            pass

    work = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        failed = work.done() and not work.cancelled() and work.exception() is not None
        run.close(_unfinished_reason(work.exception() if failed else None))
    if not work.done() or work.cancelled():
        run.note_usage(request, disconnected=True)
        return False
    error = work.exception()
    if error is not None:
        raise _engine_error(error) if isinstance(error, RequestFailedError | RequestAbortedError) else error
    run.note_usage(request)
    return True


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _sse_stream(
    run: RunState, request: Request, chunks: Callable[[], AsyncIterator[str]]
) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        finished = False
        failure: BaseException | None = None
        try:
            async for chunk in chunks():
                yield chunk
            finished = True
        except (RequestFailedError, RequestAbortedError) as error:
            failure = error
            yield _sse(json.dumps(_engine_error(error).body()))
            finished = True
        finally:
            run.close(_unfinished_reason(failure))
            run.note_usage(request, disconnected=not finished)
        yield _sse("[DONE]")

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _token_text(ctx: ServerContext, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return ctx.engine.tokenizer.decode([token_id], skip_special_tokens=False)


# ---------------------------------------------------------------- /v1/completions


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


def _completion_logprobs(
    ctx: ServerContext,
    token_ids: list[int],
    positions: Sequence[PositionLogprobs | None],
    top_n: int,
    offsets: TextOffsets,
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position else None
        result.tokens.append(_token_text(ctx, token_id, chosen))
        result.token_logprobs.append(chosen.logprob if chosen else None)
        result.text_offset.append(offsets.advance(token_id))
        if position is None:
            result.top_logprobs.append(None)
            continue
        top = {
            _token_text(ctx, tid, lp): lp.logprob
            for tid, lp in sorted(position.items(), key=lambda item: item[1].rank)
            if lp.rank <= top_n or tid == token_id
        }
        result.top_logprobs.append(top)
    return result


async def completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    _check_common(ctx, body)
    if body.suffix is not None:
        raise bad_request("suffix is not supported; leave it out.", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is only supported equal to n.", param="best_of")
    _check_fits(ctx, len(body.prompt) if _is_prompt_list(body.prompt) else 1, body.n)
    prompts, prompt_texts = await ctx.off_loop(_completion_prompts, ctx, body.prompt)
    _check_lengths(ctx, prompts, body.max_tokens, param="prompt")
    want_prompt_logprobs = body.echo and body.logprobs is not None
    params = _sampling_params(
        body, body.max_tokens, body.logprobs, body.logprobs if want_prompt_logprobs else None
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    run = RunState(
        ctx, _submit(ctx, request_id, prompts, params), body.n, prompts, keep_outputs=not body.stream
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
            result = _completion_logprobs(
                ctx, prompt_ids, prompt_positions, top_n, TextOffsets(tokenizer, (), 0)
            )
        if choice.index not in generated_offsets:
            start = len(echo_text(choice.prompt_index)) if body.echo else 0
            generated_offsets[choice.index] = TextOffsets(tokenizer, prompt_ids, start)
        step = _completion_logprobs(ctx, tokens, positions, top_n, generated_offsets[choice.index])
        result.tokens += step.tokens
        result.token_logprobs += step.token_logprobs
        result.top_logprobs += step.top_logprobs
        result.text_offset += step.text_offset
        return result

    if body.stream:
        include_usage = _include_usage(body)

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
                yield _sse(chunk.model_dump_json(exclude=None if include_usage else {"usage"}))
            if include_usage:
                final = CompletionResponse(
                    id=request_id, created=created, model=model, choices=[], usage=run.usage()
                )
                yield _sse(final.model_dump_json())

        return _sse_stream(run, request, chunks)

    if not await _collect(run, request):
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


def _include_usage(body: SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# ---------------------------------------------------------------- /v1/chat/completions


def _chat_logprobs(
    ctx: ServerContext, token_ids: list[int], positions: list[PositionLogprobs], top_n: int
) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        text = _token_text(ctx, token_id, chosen)
        top = [
            TopLogprob(
                token=_token_text(ctx, tid, lp),
                logprob=lp.logprob,
                bytes=list(_token_text(ctx, tid, lp).encode()),
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


def _check_unsupported_chat_features(body: ChatCompletionRequest) -> None:
    """Tool calling and structured output are not implemented: say so instead of ignoring them."""
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise not_supported(f"{name} (tool calling) is not supported by this server; leave it out.", name)
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise not_supported(f"{name} (tool calling) is not supported by this server; leave it out.", name)
    if body.response_format is not None and body.response_format.type != "text":
        raise not_supported(
            f"response_format {body.response_format.type!r} (structured output) is not supported by this "
            'server; only {"type": "text"}.',
            "response_format",
        )


async def chat_completion(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> Response:
    _check_common(ctx, body)
    _check_unsupported_chat_features(body)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt = await ctx.off_loop(_chat_prompt, ctx, body.messages)
    _check_lengths(ctx, [prompt], max_tokens, param="messages")
    top_n = body.top_logprobs or 0
    params = _sampling_params(body, max_tokens, top_n if body.logprobs else None, None)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    run = RunState(
        ctx, _submit(ctx, request_id, [prompt], params), body.n, [prompt], keep_outputs=not body.stream
    )
    created = now()
    model = ctx.settings.served_model_name

    if body.stream:

        async def chunks() -> AsyncIterator[str]:
            include_usage = _include_usage(body)
            exclude = set() if include_usage else {"usage"}
            for j in range(body.n):
                first = ChatCompletionChunk(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))],
                )
                yield _sse(first.model_dump_json(exclude=exclude))
            async for choice, text, tokens, logprobs in run.updates():
                if not text and not tokens and choice.finish_reason is None:
                    continue
                chunk = ChatCompletionChunk(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[
                        ChatChunkChoice(
                            index=choice.index,
                            delta=DeltaMessage(content=text) if text else DeltaMessage(),
                            logprobs=_chat_logprobs(ctx, tokens, logprobs, top_n) if body.logprobs else None,
                            finish_reason=choice.finish_reason,
                            stop_reason=choice.stop_reason,
                        )
                    ],
                )
                yield _sse(chunk.model_dump_json(exclude=exclude))
            if include_usage:
                final = ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[], usage=run.usage()
                )
                yield _sse(final.model_dump_json())

        return _sse_stream(run, request, chunks)

    if not await _collect(run, request):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=choice.text),
            logprobs=_chat_logprobs(ctx, choice.token_ids, choice.logprobs, top_n) if body.logprobs else None,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
        for index, choice in sorted(run.choices.items())
    ]
    response = ChatCompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=run.usage()
    )
    return JSONResponse(response.model_dump())


# ---------------------------------------------------------------- /tokenize, /detokenize


async def tokenize(ctx: ServerContext, body: TokenizeRequest) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of prompt or messages.", param="prompt")
    if body.model is not None and body.model != ctx.settings.served_model_name:
        raise bad_request(f"The model {body.model!r} does not exist.", param="model", code="model_not_found")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages is empty.", param="messages")
        tokens = await ctx.off_loop(_chat_prompt, ctx, body.messages, body.add_generation_prompt)
    else:
        assert body.prompt is not None
        tokens = await ctx.off_loop(
            ctx.engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.engine.max_model_len)


async def detokenize(ctx: ServerContext, body: DetokenizeRequest) -> DetokenizeResponse:
    if body.model is not None and body.model != ctx.settings.served_model_name:
        raise bad_request(f"The model {body.model!r} does not exist.", param="model", code="model_not_found")
    vocab = ctx.engine.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (size {vocab}).", param="tokens")
    return DetokenizeResponse(prompt=await ctx.off_loop(ctx.engine.tokenizer.decode, body.tokens))
