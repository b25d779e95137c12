"""POST /v1/chat/completions: messages rendered with the model's chat template; JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from inflight.engine.sequence import GuidedDecoding, PositionLogprobs, SamplingParams
from inflight.openai_errors import bad_request
from inflight.server.context import Context, ServerContext
from inflight.server.openai.common import (
    GENERATION_RESPONSES,
    ChoiceState,
    RunState,
    answer_json,
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
from inflight.server.openai.grammar import check_grammar, check_request_grammar
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
from inflight.server.openai.tools import ToolCallStream, ToolPlan, plan_tools, template_messages

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


@dataclass
class _Chat:
    """One submitted /v1/chat/completions request: its choices as JSON or as SSE chunks."""

    ctx: ServerContext
    body: ChatCompletionRequest
    run: RunState
    tools: ToolPlan | None = None
    created: int = field(default_factory=now)
    # Per streamed choice: its text turned into content and tool-call deltas (requests with tools).
    streams: dict[int, ToolCallStream] = field(default_factory=dict)

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
            with_logprobs = bool(tokens) and self.body.logprobs
            deltas, finish_reason = self.deltas(choice, text)
            if not deltas and not with_logprobs and finish_reason is None:
                continue  # tokens without text yet (part of a character, a possible stop string, a tag)
            for k, delta in enumerate(deltas or [DeltaMessage(content="" if with_logprobs else None)]):
                last = k == max(len(deltas), 1) - 1
                piece = ChatChunkChoice(
                    index=choice.index,
                    delta=delta,
                    logprobs=self.logprobs(tokens, logprobs) if k == 0 else None,
                    finish_reason=finish_reason if last else None,
                    stop_reason=choice.stop_reason if last else None,
                )
                usage = chunk_usage(self.body, self.run)
                yield sse(self.chunk([piece], usage).model_dump_json(exclude=exclude))
        if with_usage:
            yield sse(self.chunk([], usage=self.run.usage()).model_dump_json())

    def deltas(self, choice: ChoiceState, text: str) -> tuple[list[DeltaMessage], str | None]:
        """A streamed choice's new text as deltas (content, tool calls) and its finish reason."""
        if self.tools is None:
            return ([DeltaMessage(content=text)] if text else []), choice.finish_reason
        stream = self.streams.setdefault(choice.index, ToolCallStream(self.tools))
        deltas = stream.feed(text)
        if choice.finish_reason is not None:
            deltas += stream.finish()
        return deltas, _finish_reason(choice.finish_reason, bool(stream.calls))

    def message(self, choice: ChoiceState) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message (content, tool calls) and its finish reason."""
        if self.tools is None:
            return AssistantMessage(content=choice.text), choice.finish_reason
        content, calls = self.tools.parse(choice.text)
        message = AssistantMessage(content=content, tool_calls=calls or None)
        return message, _finish_reason(choice.finish_reason, bool(calls))

    def json(self) -> bytes:
        choices = []
        for index, choice in sorted(self.run.choices.items()):
            message, finish_reason = self.message(choice)
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=self.logprobs(choice.token_ids, choice.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=self.run.request_id,
            created=self.created,
            model=self.ctx.settings.served_model_name,
            choices=choices,
            usage=self.run.usage(),
        )
        return answer_json(response)


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """The finish reason: "tool_calls" for a choice that ended (stop) with calls, else the engine's."""
    return "tool_calls" if made_calls and reason == "stop" else reason


async def _check_grammar(
    ctx: ServerContext, body: ChatCompletionRequest, tools: ToolPlan | None
) -> GuidedDecoding | None:
    """Compile the grammar tool_choice or response_format asks for (400s naming the field); the tool
    grammar, which replaces the request's own (None without one)."""
    tool_grammar = tools.grammar() if tools is not None else None
    if tool_grammar is None:
        await check_request_grammar(ctx, body)
        return None
    if body.guided_requests():
        raise bad_request(
            f"tool_choice {body.tool_choice!r} and {body.guided_requests()[0][0]} both constrain the output; "
            "send one of them.",
            param="tool_choice",
        )
    await check_grammar(ctx, "tool_choice", tool_grammar)
    return tool_grammar


@dataclass
class PreparedChat:
    """A chat request ready to run: its prompt, its sampling parameters (with any tool grammar) and tools."""

    prompt: list[int]
    params: SamplingParams
    tools: ToolPlan | None
    constraint_field: str | None  # the request field whose grammar constrains the output, if any


async def prepare_chat(ctx: ServerContext, body: ChatCompletionRequest) -> PreparedChat:
    """Check a chat request against the served model, compile its grammar, render and check its prompt
    (400s naming the field). /v1/responses runs its requests through this too."""
    check_sampling(ctx, body)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", param="top_logprobs")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true; set add_generation_prompt "
            "to false.",
            param="continue_final_message",
        )
    template = ctx.engine.tokenizer.chat_template
    tools = plan_tools(body, template, ctx.settings.tool_call_parser)
    tool_grammar = await _check_grammar(ctx, body, tools)
    messages, tool_variables = template_messages(body.messages, tools, template)
    prompt = await ctx.off_loop(
        chat_prompt,
        ctx,
        messages,
        body.add_generation_prompt,
        body.continue_final_message,
        {**(body.chat_template_kwargs or {}), **tool_variables},
    )
    prompt = body.truncate(prompt)
    check_prompts(ctx, [prompt], body.max_new_tokens, param="messages")
    params = sampling_params(body)
    field = next((name for name, _ in body.guided_requests()), None)
    if tool_grammar is not None:
        params, field = replace(params, guided=tool_grammar), "tool_choice"
    return PreparedChat(prompt, params, tools, field)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    prepared = await prepare_chat(ctx, body)
    run = start_run(
        ctx, request, "chatcmpl", [prepared.prompt], prepared.params, body.stream, prepared.constraint_field
    )
    chat = _Chat(ctx, body, run, prepared.tools)
    return await respond(run, request, body.stream, chat.chunks, chat.json)
