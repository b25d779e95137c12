"""HTTP bodies of the OpenAI-compatible API (pydantic): requests are validated here, responses built here.

Range checks that depend on the loaded model (context length, vocabulary, slot count) live in
`common.py`; everything a field can say about itself is said here, so FastAPI's OpenAPI schema
documents it and a bad value becomes a 400 with the field named. A request turns itself into the
engine's `SamplingParams` (`to_sampling_params()`), once, here.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from inflight.engine.sequence import (
    GREEDY_TEMPERATURE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    GuidedDecoding,
    SamplingParams,
)

MAX_N = 64
MAX_STOP_SEQUENCES = 16
MAX_STOP_TOKEN_IDS = 256
MAX_TOOLS = 128
MAX_TOKENS_LIMIT = 2**31 - 1  # the context length is checked per model in common.py; this bounds the type

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(text: str) -> str:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); it is not text and cannot be tokenized."""
    match = _LONE_SURROGATE.search(text)
    if match is not None:
        raise ValueError(
            f"contains a lone UTF-16 surrogate (U+{ord(match.group()):04X}) at character {match.start()}; "
            "send valid Unicode text"
        )
    return text


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
TokenId = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """Unknown fields are an error (a typo such as `max_token` must not be silently ignored), and values
    are not coerced: `"max_tokens": "16"` or `"stream": "true"` is a 400, as with OpenAI and vLLM."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        default=False, description="With include_usage: every chunk carries the usage so far (vLLM's)."
    )


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`: the schema the output must validate against."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text = Field(default="response", max_length=64)
    description: Text | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="A JSON schema (an object).")
    strict: bool | None = Field(
        default=None, description="true: unsupported schema keywords are a 400; else they are ignored."
    )


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema" and only with it')
        return self

    def guided(self) -> GuidedDecoding | None:
        if self.type == "json_object":
            return GuidedDecoding("json_object")
        if self.json_schema is not None:
            schema = self.json_schema
            return GuidedDecoding("json_schema", json.dumps(schema.json_schema), strict=bool(schema.strict))
        return None


Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # JSON object keys are strings


class SamplingFields(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Unknown top-level fields are kept (`model_extra`), not refused: clients written for other servers
    send their own extras; `common.check_extra_fields` refuses the likely typos and logs the others."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = Field(default=None, description="The served model name (see /v1/models).")
    n: int = Field(default=1, ge=1, le=MAX_N, description="Completions to generate per prompt.")
    temperature: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_TEMPERATURE,
        description=f"0 = greedy; default 1. Below {GREEDY_TEMPERATURE} sampling is greedy.",
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K, description="-1 or 0 = off.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, description="1 = off."
    )
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = Field(default=None, description="Stop strings (not in the output).")
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT, description="No EOS or stop token before.")
    skip_special_tokens: bool = Field(default=True, description="Leave special tokens out of the text.")
    include_stop_str_in_output: bool = Field(default=False, description="Keep the stop string that hit.")
    spaces_between_special_tokens: bool = Field(
        default=True, description="Accepted (vLLM's); the tokenizer's decoder decides the spacing."
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_LIMIT, description="Keep only the prompt's last k tokens."
    )
    priority: int = Field(default=0, description="Accepted (vLLM's); requests are served first come first.")
    use_beam_search: bool = Field(default=False, description="Beam search is not supported; false only.")
    length_penalty: float = Field(default=1.0, description="Accepted (beam search only; not used).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(default=None, description="Accepted for compatibility; not used.")
    cache_salt: Text | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Share cached prompt prefixes only with requests of the same salt (e.g. one per tenant).",
    )
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[TokenIdKey, Bias] | None = Field(
        default=None,
        description="Token id (a JSON key: a string of digits) -> a value in [-100, 100] added to its logit.",
    )
    allowed_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, description="Only these tokens may be drawn (vLLM's)."
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object (any JSON object) or json_schema: the output matches."
    )
    guided_json: dict[str, Any] | None = Field(default=None, description="vLLM's: a JSON schema to match.")
    guided_regex: Text | None = Field(default=None, description="vLLM's: a regular expression to match.")
    guided_choice: list[Text] | None = Field(
        default=None, min_length=1, description="vLLM's: the output is one of these strings."
    )

    @property
    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids."""
        return None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}

    def guided_requests(self) -> list[tuple[str, GuidedDecoding]]:
        """Every grammar the request asks for, with the field that asks (at most one is allowed)."""
        asked: list[tuple[str, GuidedDecoding]] = []
        if self.response_format is not None and (guided := self.response_format.guided()) is not None:
            asked.append(("response_format", guided))
        if self.guided_json is not None:
            asked.append(("guided_json", GuidedDecoding("json_schema", json.dumps(self.guided_json))))
        if self.guided_regex is not None:
            asked.append(("guided_regex", GuidedDecoding("regex", self.guided_regex)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", GuidedDecoding("choice", json.dumps(self.guided_choice))))
        return asked

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """The engine's parameters from the shared fields; unset fields take the engine's "off" values.
        Raises ValueError (SamplingParams' own checks)."""
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=self.cache_salt,
            guided=next((guided for _, guided in self.guided_requests()), None),
            logit_bias=self.token_bias,
            allowed_token_ids=self.allowed_token_ids,
        )

    def truncate(self, token_ids: list[int]) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (all of them when unset)."""
        k = self.truncate_prompt_tokens
        return token_ids if k is None else token_ids[-k:]


PromptType = Text | list[Text] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    prompt: PromptType = Field(description="Text, a list of texts, token ids, or a list of token-id lists.")
    max_tokens: int | None = Field(
        default=16, le=MAX_TOKENS_LIMIT, description="Tokens to generate (>= 1); default 16."
    )
    echo: bool = Field(default=False, description="Return the prompt before the completion.")
    add_special_tokens: bool = Field(default=True, description="Add the tokenizer's BOS to text prompts.")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description="Top alternatives.")
    best_of: int | None = Field(default=None, ge=1, description="Only best_of == n is supported.")
    suffix: Text | None = Field(default=None, description="Not supported; must be null.")

    def to_sampling_params(self) -> SamplingParams:
        """With echo and logprobs, the prompt's logprobs too. Raises ValueError."""
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


# Content parts a text-only model cannot read (chat's and /v1/responses' names).
MEDIA_PART_TYPES = frozenset({"image_url", "input_audio", "file", "input_image", "input_file"})


def refuse_media_parts(content: Any) -> Any:
    """A message content's check before validation: an image, audio or file part is refused by name."""
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PART_TYPES:
            raise ValueError(
                f"{kind} content parts are not supported: the served model reads text only; send text parts"
            )
    return content


class FunctionCall(Strict):
    name: Text
    arguments: Text = Field(description="The arguments as JSON text.")


class ToolCall(Strict):
    """A call the assistant made: in an answer's `message.tool_calls`, and in the history sent back."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="A JSON schema (an object).")
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="An assistant turn's calls.")
    tool_call_id: Text | None = Field(default=None, description="The call a tool message answers.")

    _text_only = field_validator("content", mode="before")(refuse_media_parts)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        default=None, le=MAX_TOKENS_LIMIT, description="Default: the rest of the context."
    )
    max_completion_tokens: int | None = Field(
        default=None, le=MAX_TOKENS_LIMIT, description="Preferred over max_tokens."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = Field(default=True, description="End the prompt with the assistant turn.")
    continue_final_message: bool = Field(
        default=False, description="Continue the last message (no end of turn, no new turn)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="More variables for the chat template (e.g. enable_thinking)."
    )
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS, description="Function tools.")
    tool_choice: ToolChoice | None = Field(
        default=None, description='"none", "auto" (the default with tools), "required" or a named function.'
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="Several calls in one answer (default)."
    )
    functions: list[dict[str, Any]] | None = Field(default=None, description="Deprecated; use tools.")
    function_call: str | dict[str, Any] | None = Field(
        default=None, description="Deprecated; use tool_choice."
    )

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens; None = the rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        """Raises ValueError."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_new_tokens, logprobs, None)


class TokenizeRequest(Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class WithoutNone(BaseModel):
    """Sent without its None fields, as OpenAI's stream deltas are: the SDK's stream accumulation takes a
    later `"type": null` for the call's type."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields: dict[str, Any] = handler(self)
        return {name: value for name, value in fields.items() if value is not None}


class DeltaFunctionCall(WithoutNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(WithoutNone):
    """A streamed piece of a tool call: the first carries id, type and name, later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(WithoutNone):
    """Only the fields that are set are sent: the last chunk's delta is `{}`, as OpenAI's."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inflight"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
