"""Tool calling on /v1/chat/completions: what a request's tools mean for its prompt, its grammar and its
answer.

- Prompt: a chat template that knows tools (its source uses `tools`) gets them as the `tools` variable
  and the history's calls as `tool_calls` (Hugging Face's convention); any other template gets the
  built-in format (Hermes / Qwen 2.5's): a system prompt listing the tools in `<tools></tools>` and
  asking for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, earlier calls written that
  way into their assistant turns, and tool results as user turns in `<tool_response></tool_response>`.
- Grammar: `tool_choice` "required" makes the output a JSON array of `{"name", "parameters"}` objects
  (1 to MAX_PARALLEL_CALLS calls; one without `parallel_tool_calls`), a named function makes it that
  function's arguments object (vLLM's forms): both always parse and validate.
- Answer: "auto" parses the model's text with the parser of the template's family (`<tool_call>` blocks,
  or Llama 3.1's bare `{"name", "parameters"}` JSON); calls become `message.tool_calls` with ids and
  `finish_reason: "tool_calls"`. `ToolCallStream` does the same for a stream, as `delta.tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from inflight.engine.sequence import GuidedDecoding
from inflight.openai_errors import bad_request, not_supported
from inflight.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ToolMode = Literal["auto", "required", "named"]
# Calls in one "required" answer: small models otherwise repeat a call until max_tokens.
MAX_PARALLEL_CALLS = 4
ParserName = Literal["hermes", "llama3_json"]

BUILTIN_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parser_for(template: str | None) -> ParserName:
    """The output parser of a chat template's family: Llama 3.1's JSON, else `<tool_call>` blocks."""
    return "llama3_json" if template is not None and "<|python_tag|>" in template else "hermes"


@dataclass
class ToolPlan:
    """A request's tools: how they are asked for (mode), which may be called, and how output is parsed."""

    mode: ToolMode
    tools: list[Tool]
    parallel: bool
    parser: ParserName = "hermes"
    named: str | None = None

    def grammar(self) -> GuidedDecoding | None:
        """The output's grammar for "required" and a named function; None for "auto"."""
        if self.mode == "named":
            return GuidedDecoding("json_schema", json.dumps(_parameters(self._tool(self.named))))
        if self.mode == "required":
            calls = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": tool.function.name},
                            "parameters": _parameters(tool),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for tool in self.tools
                ]
            }
            limit = MAX_PARALLEL_CALLS if self.parallel else 1
            array: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1, "maxItems": limit}
            return GuidedDecoding("json_schema", json.dumps(array))
        return None

    def _tool(self, name: str | None) -> Tool:
        return next(tool for tool in self.tools if tool.function.name == name)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """An answer's content (None when it is only calls) and its calls."""
        if self.mode == "named":
            return None, [_call(self.named or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short (max_tokens): no call can be read
            return None, [_call(item["name"], json.dumps(item["parameters"])) for item in items]
        parse = _parse_hermes if self.parser == "hermes" else _parse_llama3_json
        return parse(text)


def plan_tools(body: ChatCompletionRequest, template: str | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools or with tool_choice "none"); 400s for what cannot be."""
    if body.functions:
        raise not_supported("functions is deprecated and not supported; send tools instead.", "functions")
    if body.function_call is not None:
        raise not_supported("function_call is not supported; send tool_choice instead.", "function_call")
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools; send the tools it may call.", param="tool_choice")
        return None
    if choice == "none":
        return None
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) < len(names):
        raise bad_request("tools must have distinct function names.", param="tools")
    parallel = body.parallel_tool_calls is not False
    parser = parser_for(template)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not one of the tools.",
                param="tool_choice",
            )
        return ToolPlan("named", body.tools, parallel, parser, choice.function.name)
    return ToolPlan("required" if choice == "required" else "auto", body.tools, parallel, parser)


def template_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra variables to render: the template's own tool support where it has one
    (its source uses `tools`), else the built-in format."""
    native = template is not None and "tools" in template
    if native:
        rendered = [_native_message(m) for m in messages]
        tools = [tool.model_dump(exclude_none=True) for tool in plan.tools] if plan is not None else None
        return rendered, {"tools": tools} if tools else {}
    rendered = [_builtin_message(m) for m in messages]
    if plan is not None:
        listing = "\n".join(json.dumps(tool.model_dump(exclude_none=True)) for tool in plan.tools)
        prompt = BUILTIN_TOOL_PROMPT.format(tools=listing)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _loaded_arguments(arguments: str) -> Any:
    """A history call's arguments as the object templates expect (the text when it is not JSON)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _native_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _loaded_arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _builtin_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text()}\n</tool_response>"}
    content = message.text()
    for call in message.tool_calls or []:
        block = json.dumps(
            {"name": call.function.name, "arguments": _loaded_arguments(call.function.arguments)}
        )
        content += f"{chr(10) if content else ''}{TOOL_CALL_OPEN}\n{block}\n{TOOL_CALL_CLOSE}"
    return {"role": message.role, "content": content}


def _call_from(item: Any) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return _call(item["name"], _arguments(arguments))


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _TOOL_CALL_BLOCK.findall(text[start:]):
        try:
            call = _call_from(json.loads(block))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: the answer is text
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>")
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        try:
            call = _call_from(json.loads(part))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


@dataclass
class ToolCallStream:
    """One streamed choice's text turned into chat deltas: content as it comes, calls as they are known.

    A named function streams its arguments as they are generated; "required" and "auto" calls are sent
    once the choice ends (each call whole: id, name and arguments in one delta). "auto" with `<tool_call>`
    blocks streams the text before the first block, holding back what could be the start of its tag;
    Llama 3.1's JSON is only known at the end, so that parser's text is sent then."""

    plan: ToolPlan
    text: str = ""  # everything generated so far
    sent: int = 0  # characters of `text` sent as content
    started: bool = False  # a named call's first delta (id, name) went out
    calls: list[ToolCall] = field(default_factory=list)
    call_id: str = field(default_factory=new_call_id)

    def feed(self, delta: str) -> list[DeltaMessage]:
        self.text += delta
        if self.plan.mode == "named":
            if self.started and not delta:
                return []
            first, self.started = not self.started, True
            function = DeltaFunctionCall(name=self.plan.named if first else None, arguments=delta)
            call = DeltaToolCall(
                index=0,
                id=self.call_id if first else None,
                type="function" if first else None,
                function=function,
            )
            return [DeltaMessage(tool_calls=[call])]
        if self.plan.mode == "auto" and self.plan.parser == "hermes":
            return self._content(final=False)
        return []

    def finish(self) -> list[DeltaMessage]:
        """The deltas left when the choice ends."""
        if self.plan.mode == "named":
            self.calls = [
                ToolCall(
                    id=self.call_id, function=FunctionCall(name=self.plan.named or "", arguments=self.text)
                )
            ]
            return []
        content, self.calls = self.plan.parse(self.text)
        if not self.calls:
            return self._content(final=True)
        deltas = self._content(final=True, upto=self.text.find(TOOL_CALL_OPEN)) if content is not None else []
        for index, call in enumerate(self.calls):
            function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
            delta = DeltaToolCall(index=index, id=call.id, type="function", function=function)
            deltas.append(DeltaMessage(tool_calls=[delta]))
        return deltas

    def _content(self, final: bool, upto: int = -1) -> list[DeltaMessage]:
        """Content not sent yet: up to `upto` (a call's start), all of it at the end, else up to what could
        begin a tag."""
        if upto >= 0:
            end = upto
        elif final:
            end = len(self.text)
        else:
            tag = self.text.find(TOOL_CALL_OPEN, self.sent)
            end = tag if tag >= 0 else len(self.text) - _partial_tag(self.text)
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent : end], end
        return [DeltaMessage(content=piece)]


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin a `<tool_call>` tag."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
