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
- Answer: "auto" parses the model's text with the server's --tool-call-parser (`<tool_call>` blocks, or
  Llama 3.1's bare `{"name", "parameters"}` JSON; by default the template's family); calls become
  `message.tool_calls` with ids and `finish_reason: "tool_calls"`. `ToolCallStream` reads a stream the
  same way, sending `delta.tool_calls` as the calls are generated.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from inflight.engine.sequence import GuidedDecoding
from inflight.openai_errors import bad_request, not_supported
from inflight.server.openai.call_reader import CallReader
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
from inflight.server.tool_parsers import LLAMA3_PYTHON_TAG, ParserChoice, ParserName, parser_for

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ToolMode = Literal["auto", "required", "named"]
# Calls in one "required" answer: small models otherwise repeat a call until max_tokens.
MAX_PARALLEL_CALLS = 4

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
        """A whole answer's content (None when there is none) and its calls, read as a stream reads them."""
        stream = ToolCallStream(self)
        stream.feed(text)
        stream.finish()
        return (stream.content if stream.content.strip() else None), stream.calls


def plan_tools(
    body: ChatCompletionRequest, template: str | None, parser: ParserChoice = "auto"
) -> ToolPlan | None:
    """The request's ToolPlan (None without tools or with tool_choice "none"); 400s for what cannot be.
    `parser`: the server's --tool-call-parser ("auto": the template's family)."""
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
    output_parser = parser_for(parser, template)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not one of the tools.",
                param="tool_choice",
            )
        return ToolPlan("named", body.tools, parallel, output_parser, choice.function.name)
    return ToolPlan("required" if choice == "required" else "auto", body.tools, parallel, output_parser)


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


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str)


def _well_formed(mode: ToolMode, parser: ParserName, text: str) -> bool:
    """Whether `text` is wholly calls in the expected form ("required": a JSON array of calls; "auto": the
    parser's call blocks, at least one): else an answer is its text (with no calls)."""
    try:
        if mode == "required":
            return isinstance(json.loads(text), list)
        if parser == "hermes":
            start = text.find(TOOL_CALL_OPEN)
            blocks = _TOOL_CALL_BLOCK.findall(text[start:]) if start >= 0 else []
        else:
            body = text.strip().removeprefix(LLAMA3_PYTHON_TAG)
            blocks = body.split(";") if body.startswith("{") else []
        return bool(blocks) and all(_is_call(json.loads(block)) for block in blocks)
    except json.JSONDecodeError:
        return False


@dataclass
class ToolCallStream:
    """One choice's text turned into chat deltas as it is generated: content as it comes, each call's
    first delta (index, id, type, name, arguments "") once its name is known, then its argument text
    in pieces as written. A whole answer is read the same way (`ToolPlan.parse`).

    - named function: all the text is the arguments;
    - "required": the calls of the JSON array;
    - "auto", hermes: content up to the first `<tool_call>` (holding back what could begin the tag),
      then the calls of the blocks (text between blocks is dropped);
    - "auto", llama3_json: calls when the text starts with `{` (or `<|python_tag|>`), else content.

    Text that turns out not to be calls (`_well_formed` fails at the end, e.g. a broken block) is sent as
    content at the end, unless a call's first delta already went out: then the calls read so far stand."""

    plan: ToolPlan
    text: str = ""  # everything generated so far
    sent: int = 0  # characters of `text` sent as content
    read: int = 0  # characters of `text` read for calls
    in_calls: bool = False  # the text turned to calls: no more content
    in_block: bool = False  # hermes: inside a <tool_call> block
    content: str = ""  # the content sent
    readers: list[CallReader] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)  # the calls announced (first delta out), by index
    calls: list[ToolCall] = field(default_factory=list)  # once finished

    def __post_init__(self) -> None:
        self.in_calls = self.plan.mode == "required"

    def feed(self, delta: str) -> list[DeltaMessage]:
        self.text += delta
        if self.plan.mode == "named":
            return self._named(delta)
        deltas = self._content(final=False) if not self.in_calls else []
        if self.in_calls:
            self._read_calls()
        return deltas + self._call_deltas()

    def finish(self) -> list[DeltaMessage]:
        """The deltas left when the choice ends."""
        if self.plan.mode == "named":
            self.calls = [self._call(0, self.plan.named or "", self.text)]
            return []
        if not self.ids and not _well_formed(self.plan.mode, self.plan.parser, self.text):
            self.in_calls, self.readers = False, []
            return self._content(final=True)
        deltas = [] if self.in_calls else self._content(final=True)
        deltas += self._call_deltas()
        self.calls = [
            self._call(index, reader.name or "", reader.arguments or "")
            for index, reader in enumerate(self.readers[: len(self.ids)])
        ]
        return deltas

    def _named(self, delta: str) -> list[DeltaMessage]:
        if self.ids and not delta:
            return []
        first = not self.ids
        if first:
            self.ids.append(new_call_id())
        function = DeltaFunctionCall(name=self.plan.named if first else None, arguments=delta)
        return [DeltaMessage(tool_calls=[self._piece(0, first, function)])]

    def _call(self, index: int, name: str, arguments: str) -> ToolCall:
        return ToolCall(id=self.ids[index], function=FunctionCall(name=name, arguments=arguments))

    def _piece(self, index: int, first: bool, function: DeltaFunctionCall) -> DeltaToolCall:
        return DeltaToolCall(
            index=index,
            id=self.ids[index] if first else None,
            type="function" if first else None,
            function=function,
        )

    def _call_deltas(self) -> list[DeltaMessage]:
        """A first delta for each call whose name became known, then its new argument text."""
        deltas = []
        for index, reader in enumerate(self.readers):
            first = index == len(self.ids)
            if first:
                if reader.name is None:
                    break
                self.ids.append(new_call_id())
                function = DeltaFunctionCall(name=reader.name, arguments="")
                deltas.append(DeltaMessage(tool_calls=[self._piece(index, True, function)]))
            piece = reader.take_arguments()
            if piece:
                function = DeltaFunctionCall(arguments=piece)
                deltas.append(DeltaMessage(tool_calls=[self._piece(index, False, function)]))
        return deltas

    def _read_calls(self) -> None:
        """Read the text after `read` into call readers (a new one at each call's `{`)."""
        while self.read < len(self.text):
            reader = self.readers[-1] if self.readers else None
            if reader is not None and not reader.done:
                self.read += reader.feed(self.text[self.read :])
                continue
            if self.plan.parser == "hermes" and self.plan.mode == "auto" and not self.in_block:
                tag = self.text.find(TOOL_CALL_OPEN, self.read)
                if tag < 0:
                    self.read = max(self.read, len(self.text) - _partial_tag(self.text))
                    return
                self.read, self.in_block = tag + len(TOOL_CALL_OPEN), True
                continue
            start = self.text.find("{", self.read)
            if start < 0:
                self.read = len(self.text)
                return
            self.read, self.in_block = start, False
            self.readers.append(CallReader())

    def _content(self, final: bool) -> list[DeltaMessage]:
        """Content not sent yet, up to where calls begin (then reading turns to calls): at the end all
        of it; before, up to what could begin a `<tool_call>` tag or Llama 3.1's call."""
        end = len(self.text)
        if not final and self.plan.parser == "hermes":
            tag = self.text.find(TOOL_CALL_OPEN, self.sent)
            if tag >= 0:
                end, self.in_calls, self.read = tag, True, tag
            else:
                end -= _partial_tag(self.text)
        elif not final and self.sent == 0:
            head = self.text.lstrip()
            if head.startswith("{") or head.startswith(LLAMA3_PYTHON_TAG):
                end, self.in_calls = 0, True
            elif not head or LLAMA3_PYTHON_TAG.startswith(head):
                end = 0  # cannot tell yet
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent : end], end
        self.content += piece
        return [DeltaMessage(content=piece)]


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin a `<tool_call>` tag."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
