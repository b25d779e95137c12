"""HTTP bodies of /v1/responses (pydantic): the request, its input items, and the response object.

The request is turned into a chat request (`to_chat()`, in responses.py), so everything a chat request
checks (model, sampling bounds, tools, schemas) is checked once, the same way.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inflight.server.openai.protocol import (
    MAX_TOKENS_LIMIT,
    Strict,
    Text,
    refuse_media_parts,
)


class ContentPart(Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ContentPart]
    id: str | None = None
    status: str | None = None

    _text_only = field_validator("content", mode="before")(refuse_media_parts)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class TextFormat(Strict):
    """`text.format`: "text", "json_object", or "json_schema" with the schema fields inline."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat completions `response_format` saying the same."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {
            "name": self.name or "response",
            "description": self.description,
            "schema": self.json_schema or {},
            "strict": self.strict,
        }
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(Strict):
    format: TextFormat | None = None


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: Text


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown top-level fields are ignored with a log line (as on chat)."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    input: Text | list[InputItem] = Field(description="A text, or message / function-call items.")
    instructions: Text | None = Field(default=None, description="A system message for this response only.")
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, description="Function tools only.")
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = Field(
        default=True, description="Keep it for previous_response_id (in memory, per replica)."
    )
    previous_response_id: Text | None = None
    metadata: dict[str, str] | None = None
    user: Text | None = None
    background: bool = Field(default=False, description="Not supported; false only.")


def now() -> float:
    return time.time()


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=now)
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
