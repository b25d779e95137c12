"""What /v1/completions and /v1/chat/completions share: the checks that depend on the loaded model, the
run of one HTTP request on the async engine (choices, usage, finish metrics), the JSON collect and the
SSE stream, error mapping, and logprob token text.

One HTTP request becomes one engine request per prompt (each with `n` sequences). Choice `i * n + j` is
sequence `j` of prompt `i`. Usage counts each prompt once and every generated token.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from pydantic_core import to_json

from inflight.engine.async_engine import (
    EngineUnavailableError,
    Generation,
    GenerationRequest,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
)
from inflight.engine.errors import ConstraintFailure
from inflight.engine.sequence import Logprob, PositionLogprobs, SamplingParams
from inflight.engine.tokenizer import TokenizerError
from inflight.openai_errors import CLIENT_CLOSED_REQUEST, APIError, bad_request, echoed, error_responses
from inflight.server.context import ServerContext
from inflight.server.openai.protocol import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    Usage,
)

if TYPE_CHECKING:
    from inflight.engine.output_processor import CompletionOutput  # imports torch; the type only

logger = logging.getLogger(__name__)

# The OpenAPI `responses=` of a generating endpoint.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"},
    **error_responses(429, 500),
}
# An unknown field this close to a known one (difflib's ratio) is taken for a typo: max_token, temprature.
TYPO_SIMILARITY = 0.85


# ---------------------------------------------------------------- checks against the loaded model


def check_model(ctx: ServerContext, model: str | None, status: int = 400) -> None:
    """`model`, when given, must be the served model name: a 400 for a body field, a 404 for a path."""
    served = ctx.settings.served_model_name
    if model is not None and model != served:
        raise APIError(
            status,
            f"The model {echoed(model)} does not exist; this server serves {served!r} (see /v1/models).",
            param="model" if status == 400 else None,
            code="model_not_found",
        )


def check_in_vocabulary(ctx: ServerContext, token_ids: Sequence[int], param: str) -> None:
    vocab = ctx.engine.vocab_size
    outside = [t for t in token_ids if t >= vocab]
    if outside:
        raise bad_request(f"token ids {outside[:5]} are outside the vocabulary (size {vocab}).", param=param)


def check_extra_fields(body: BaseModel) -> None:
    """Unknown fields are ignored with a log line (vLLM's rule: clients written for other servers send
    their own extras), except one that looks like a typo of a known field (`max_token`): a 400."""
    extra = sorted(body.model_extra or {})
    if not extra:
        return
    known = list(type(body).model_fields)
    for name in extra:
        close = difflib.get_close_matches(name, known, n=1, cutoff=TYPO_SIMILARITY)
        if close:
            raise bad_request(f"Unknown field {name!r}; did you mean {close[0]!r}?", param=name)
    logger.warning("ignoring unknown request fields: %s", ", ".join(extra))


def check_sampling(ctx: ServerContext, body: SamplingFields) -> None:
    """The shared fields against the served model and what the server supports."""
    check_model(ctx, body.model)
    check_extra_fields(body)
    if body.use_beam_search:
        raise bad_request("use_beam_search is not supported; leave it out.", param="use_beam_search")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    guided = body.guided_requests()
    if len(guided) > 1:
        names = " and ".join(name for name, _ in guided)
        raise bad_request(f"{names} each constrain the output; send one of them.", param=guided[1][0])
    check_in_vocabulary(ctx, list(body.token_bias or {}), "logit_bias")
    check_in_vocabulary(ctx, body.allowed_token_ids or [], "allowed_token_ids")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop takes at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}.", param="stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty.", param="stop")
    if body.n > ctx.engine.max_slots:
        raise bad_request(
            f"n={body.n} needs {body.n} slots but this server has {ctx.engine.max_slots}; lower n.", param="n"
        )
    check_in_vocabulary(ctx, body.stop_token_ids or [], "stop_token_ids")


def check_prompts(ctx: ServerContext, prompts: list[list[int]], max_tokens: int | None, param: str) -> None:
    """`param`: the request field that holds the prompt(s)."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    for ids in prompts:
        check_in_vocabulary(ctx, ids, param)
        # The engine's length rules, mapped once to the HTTP error. n is checked against the server's
        # slots (check_sampling), which may exceed the engine's: the engine then fails the request itself.
        error = ctx.engine.capacity_error(len(ids), max_tokens)
        if error is not None:
            raise bad_request(
                error.message, param=param if error.param == "prompt" else error.param, code=error.code
            )


def sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    try:
        return body.to_sampling_params()
    except ValueError as error:
        raise bad_request(str(error)) from error


def chat_prompt(
    ctx: ServerContext,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    variables: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids of `messages` (as the template reads them: tools.template_messages) rendered with the
    model's chat template (`variables`: more template variables, e.g. tools, chat_template_kwargs)."""
    tokenizer = ctx.engine.tokenizer
    try:
        return tokenizer.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=variables,
        )
    except TokenizerError as error:
        raise bad_request(str(error), param="messages") from error
    except Exception as error:  # a template's raise_exception(...) or a rendering error
        raise bad_request(f"The chat template rejected the messages: {error}", param="messages") from error


def include_usage(body: SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def chunk_usage(body: SamplingFields, run: RunState) -> Usage | None:
    """A stream chunk's usage: the counts so far with `continuous_usage_stats` (and include_usage)."""
    options = body.stream_options
    continuous = options is not None and options.include_usage and options.continuous_usage_stats
    return run.usage() if continuous else None


def token_text(ctx: ServerContext, token_id: int, logprob: Logprob | None) -> str:
    """A logprob token's text: the engine's decoding when it sent one."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return ctx.engine.tokenizer.decode([token_id], skip_special_tokens=False)


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


def start_run(
    ctx: ServerContext,
    request: Request,
    kind: str,
    prompts: list[list[int]],
    params: SamplingParams,
    stream: bool,
    constraint_field: str | None = None,
) -> RunState:
    """Submit one engine request per prompt under a new request id `{kind}-{hex}` (noted for the access
    log); 429 when the queue is full, 503 when the engine is not serving."""
    request_id = f"{kind}-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    generation = _submit(ctx, request_id, prompts, params)
    keep = not stream
    return RunState(
        ctx, request_id, generation, params.n, prompts, keep_outputs=keep, constraint_field=constraint_field
    )


def _unfinished_reason(error: BaseException | None) -> str:
    """The finish reason of choices cut short: "error" when the engine failed them, else "abort"."""
    return "error" if isinstance(error, RequestFailedError) else "abort"


class ConstraintFailedError(RequestFailedError):
    """A sequence failed on its own constraint (engine.errors.ConstraintFailure): the request's fault."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


def _engine_error(error: Exception) -> APIError:
    if isinstance(error, RequestAbortedError):
        return APIError(503, str(error), code="shutting_down")
    if isinstance(error, ConstraintFailedError):
        return bad_request(
            f"{error.field or 'the request'}: the output could not follow this constraint to the end "
            f"({error}); simplify the schema or grammar (e.g. give recursive objects a way out).",
            param=error.field,
            code="constraint_failed",
        )
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
    request_id: str
    generation: Generation
    n: int
    prompts: list[list[int]]
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[PositionLogprobs | None]] = field(default_factory=dict)
    # False for streams: choices keep counts, not the text and logprobs already sent.
    keep_outputs: bool = True
    # The request field whose grammar constrains the output (named when that grammar fails), if any.
    constraint_field: str | None = None

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
                        why = choice.error or output.error or "the engine failed this sequence"
                        if isinstance(why, ConstraintFailure):
                            raise ConstraintFailedError(why, self.constraint_field)
                        raise RequestFailedError(why)
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


def sse(payload: str) -> str:
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
            yield sse(json.dumps(_engine_error(error).body()))
            finished = True
        finally:
            run.close(_unfinished_reason(failure))
            run.note_usage(request, disconnected=not finished)
        yield sse("[DONE]")

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def answer_json(response: CompletionResponse | ChatCompletionResponse) -> bytes:
    """`response` as JSON, its choices serialized one at a time: a thread building a large answer (tens of
    MB with echo and logprobs) then holds the GIL for one choice at a time, not for the whole answer
    (json.dumps of a 36 MB answer held it for ~0.9 s), so the event loop answers in between."""
    head = to_json(response.model_copy(update={"choices": []}))
    choices = b",".join(to_json(choice) for choice in response.choices)
    # Quotes inside JSON strings are escaped: the first '"choices":[]' is the field itself.
    return head.replace(b'"choices":[]', b'"choices":[' + choices + b"]", 1)


async def respond(
    run: RunState,
    request: Request,
    stream: bool,
    chunks: Callable[[], AsyncIterator[str]],
    answer: Callable[[], bytes],
) -> Response:
    """The SSE stream of `chunks`, or (once every choice finished) the JSON `answer`, built in a worker
    thread: an answer can be tens of MB, and building it on the event loop stalled every other request."""
    if stream:
        return _sse_stream(run, request, chunks)
    if not await _collect(run, request):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(await run.ctx.off_loop(answer), media_type="application/json")
