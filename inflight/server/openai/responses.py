"""POST /v1/responses: OpenAI's Responses API over the chat path; GET / DELETE /v1/responses/{id}: the store.

A request becomes a chat request (instructions as a system message, the stored conversation of
`previous_response_id`, then the input items: messages, function calls, function call outputs; tools,
tool_choice and text.format carried over), runs through `prepare_chat` like any chat request, and its one
choice is answered as output items: a message (`output_text`) and/or `function_call` items. Streams send
the Responses event types (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each with a sequence number.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from inflight.openai_errors import APIError, bad_request, echoed, error_responses, not_supported
from inflight.server.context import Context, ServerContext
from inflight.server.openai.chat import prepare_chat
from inflight.server.openai.common import (
    GENERATION_RESPONSES,
    RunState,
    check_extra_fields,
    respond,
    start_run,
)
from inflight.server.openai.protocol import ChatCompletionRequest, DeltaMessage, ToolCall
from inflight.server.openai.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from inflight.server.openai.tools import ToolCallStream, ToolPlan
from inflight.server.response_store import StoredResponse

router = APIRouter(tags=["openai"])

# A chat field an error names -> the Responses field the client sent.
CHAT_TO_RESPONSES_PARAM = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
}


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def _history(ctx: ServerContext, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation before this request's input: the stored one of previous_response_id."""
    if body.previous_response_id is None:
        return []
    stored = ctx.responses.get(body.previous_response_id)
    if stored is None:
        raise bad_request(
            f"Previous response {body.previous_response_id!r} is not stored on this server (responses are "
            "kept in memory, per replica, for a bounded number of responses).",
            param="previous_response_id",
        )
    return list(stored.messages)


def _input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages (consecutive function calls join one assistant turn)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools in the chat form; a built-in tool (web search, files, ...) is a 400."""
    if not body.tools:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind != "function":
            raise not_supported(
                f"tools[{i}]: the built-in tool {kind!r} is not supported; only function tools.", "tools"
            )
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        tools.append({"type": "function", "function": function})
    return tools


def to_chat(ctx: ServerContext, body: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request saying the same, and the conversation to store (without the instructions, which
    do not carry over to the next response)."""
    conversation = [*_history(ctx, body), *_input_messages(body)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": [*system, *conversation],
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": _tools(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": body.stream,
    }
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = body.text.format.response_format()
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        ), conversation
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise bad_request(
            f"{where}: {first['msg']}", param="input" if where.startswith("messages") else where
        ) from error


@dataclass
class _Response:
    """One submitted /v1/responses request: its output items as JSON or as Responses stream events."""

    ctx: ServerContext
    body: ResponsesRequest
    run: RunState
    tools: ToolPlan | None
    conversation: list[dict[str, Any]]
    response_id: str = field(default_factory=lambda: _item_id("resp"))
    sequence: int = 0

    def response(
        self, output: list[OutputItem], finish_reason: str | None, done: bool = True
    ) -> ResponseObject:
        incomplete = finish_reason == "length"
        usage = self.run.usage()
        return ResponseObject(
            id=self.response_id,
            status=("incomplete" if incomplete else "completed") if done else "in_progress",
            model=self.ctx.settings.served_model_name,
            output=output,
            usage=ResponseUsage(
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
            )
            if done
            else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete and done else None,
            instructions=self.body.instructions,
            max_output_tokens=self.body.max_output_tokens,
            temperature=self.body.temperature,
            top_p=self.body.top_p,
            tools=self.body.tools or [],
            tool_choice=self.body.tool_choice or "auto",
            parallel_tool_calls=self.body.parallel_tool_calls is not False,
            text=self.body.text.model_dump(by_alias=True, exclude_none=True) if self.body.text else None,
            previous_response_id=self.body.previous_response_id,
            store=self.body.store,
            metadata=self.body.metadata or {},
        )

    def output(self, content: str | None, calls: list[ToolCall]) -> list[OutputItem]:
        items: list[OutputItem] = []
        if content:
            items.append(OutputMessage(id=_item_id("msg"), content=[OutputText(text=content)]))
        items += [
            OutputFunctionCall(
                id=_item_id("fc"), call_id=c.id, name=c.function.name, arguments=c.function.arguments
            )
            for c in calls
        ]
        return items

    def remember(self, content: str | None, calls: list[ToolCall], response: bytes) -> bytes:
        """Store the response (when `store`) for previous_response_id and GET; return it."""
        if self.body.store:
            turn: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                turn["tool_calls"] = [call.model_dump() for call in calls]
            self.ctx.responses.put(self.response_id, StoredResponse([*self.conversation, turn], response))
        return response

    def json(self) -> bytes:
        choice = self.run.choices[0]
        content, calls = self.tools.parse(choice.text) if self.tools is not None else (choice.text, [])
        response = self.response(self.output(content, calls), choice.finish_reason)
        return self.remember(content, calls, to_json(response))

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """response.created / in_progress, each output item's added, deltas and done events, completed."""
        start = self.response([], None, done=False).model_dump()
        yield self.event("response.created", response=start)
        yield self.event("response.in_progress", response=start)
        items = _StreamedItems(self)
        stream = ToolCallStream(self.tools) if self.tools is not None else None
        finish_reason: str | None = None
        async for choice, text, _, _ in self.run.updates():
            deltas = (
                stream.feed(text) if stream is not None else ([DeltaMessage(content=text)] if text else [])
            )
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
                deltas += stream.finish() if stream is not None else []
            for delta in deltas:
                for event in items.add(delta):
                    yield event
        for event in items.close():
            yield event
        calls = stream.calls if stream is not None else []
        response = self.response(items.done, finish_reason)
        self.remember(items.content or None, calls, to_json(response))
        yield self.event("response.completed", response=response.model_dump())


@dataclass
class _StreamedItems:
    """The open output item of a stream (a message being written, or a function call) and those done."""

    owner: _Response
    done: list[OutputItem] = field(default_factory=list)
    content: str = ""
    message: OutputMessage | None = None
    call: OutputFunctionCall | None = None

    def add(self, delta: DeltaMessage) -> list[str]:
        events: list[str] = []
        if delta.content:
            if self.message is None:
                events += self.close()
                self.message = OutputMessage(id=_item_id("msg"), status="in_progress")
                events.append(self._item_event("response.output_item.added", self.message))
                part = OutputText(text="").model_dump()
                events.append(
                    self._event(
                        "response.content_part.added", item_id=self.message.id, content_index=0, part=part
                    )
                )
            self.content += delta.content
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.message.id,
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                events += self.close()
                self.call = OutputFunctionCall(
                    id=_item_id("fc"),
                    call_id=piece.id,
                    name=piece.function.name or "",
                    arguments="",
                    status="in_progress",
                )
                events.append(self._item_event("response.output_item.added", self.call))
            if self.call is not None and piece.function.arguments:
                self.call.arguments += piece.function.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self.call.id,
                        delta=piece.function.arguments,
                    )
                )
        return events

    def close(self) -> list[str]:
        """Finish the open item (its done events)."""
        events: list[str] = []
        if self.message is not None:
            text = self.content
            part = OutputText(text=text)
            self.message.content, self.message.status = [part], "completed"
            item_id = self.message.id
            events.append(
                self._event(
                    "response.output_text.done", item_id=item_id, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self._event(
                    "response.content_part.done", item_id=item_id, content_index=0, part=part.model_dump()
                )
            )
            events.append(self._item_event("response.output_item.done", self.message))
            self.done.append(self.message)
            self.message = None
        if self.call is not None:
            self.call.status = "completed"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=self.call.id,
                    arguments=self.call.arguments,
                )
            )
            events.append(self._item_event("response.output_item.done", self.call))
            self.done.append(self.call)
            self.call = None
        return events

    def _event(self, kind: str, **fields: Any) -> str:
        return self.owner.event(kind, output_index=len(self.done), **fields)

    def _item_event(self, kind: str, item: OutputItem) -> str:
        return self._event(kind, item=item.model_dump())


@router.post("/v1/responses", response_model=ResponseObject, responses=GENERATION_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request, ctx: Context) -> Response:
    check_extra_fields(body)
    if body.background:
        raise not_supported("background responses are not supported; leave background out.", "background")
    chat, conversation = to_chat(ctx, body)
    try:
        prepared = await prepare_chat(ctx, chat)
    except APIError as error:
        error.param = CHAT_TO_RESPONSES_PARAM.get(error.param or "", error.param)
        raise
    run = start_run(
        ctx, request, "resp", [prepared.prompt], prepared.params, body.stream, prepared.constraint_field
    )
    answer = _Response(ctx, body, run, prepared.tools, conversation)
    return await respond(run, request, body.stream, answer.events, answer.json)


def _not_stored(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response with id {echoed(response_id)} is stored on this server (responses are kept in memory, "
        "per replica, for a bounded number of responses, and only with store: true).",
        param="response_id",
        code="response_not_found",
    )


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=error_responses(404))
async def get_response(response_id: str, ctx: Context) -> Response:
    """A stored response, as it was answered (this replica's store)."""
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise _not_stored(response_id)
    return Response(stored.response, media_type="application/json")


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=error_responses(404))
async def delete_response(response_id: str, ctx: Context) -> ResponseDeleted:
    """Forget a stored response: it can no longer be fetched or continued from."""
    if not ctx.responses.delete(response_id):
        raise _not_stored(response_id)
    return ResponseDeleted(id=response_id)
