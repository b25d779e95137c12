"""Requests as the scheduler sees them: sampling parameters and per-sequence state (no torch).

A request asks for `n` completions of one prompt. It starts as one `Sequence` (index 0) that carries the
prompt; when its prompt has been computed the scheduler forks it into `n` sequences that share the
prompt's KV blocks (ref counts), and each samples its own continuation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

MAX_LOGPROBS = 20
# The API's bounds of the numeric sampling fields (the server's protocol reads them; one source). The
# engine takes some wider values: top_k above the vocabulary means off, a temperature below
# GREEDY_TEMPERATURE is greedy.
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
MIN_REPETITION_PENALTY = 1e-2  # 1 / penalty scales logits: 1e-300 would overflow float32
MAX_REPETITION_PENALTY = 100.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]
# Temperatures below this sample greedily: dividing logits by them overflows to inf/NaN (vLLM's rule).
GREEDY_TEMPERATURE = 1e-5
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)

MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)

FinishReason = str  # "stop" | "length" | "abort" | "error"
# What each step's output of a request holds: everything so far, or only what is new since the last one.
OutputKind = Literal["cumulative", "delta"]


GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]


@dataclass(frozen=True)
class GuidedDecoding:
    """What a request's output must match (constrained decoding; `engine/guided.py` compiles it).

    `value`: the JSON schema as JSON text, the regular expression, the JSON list of choice strings, or the
    Lark grammar ("" for json_object: any JSON object). `strict` False: schema keywords the grammar
    library does not implement are ignored instead of refused."""

    kind: GuidedKind
    value: str = ""
    strict: bool = True


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's names and meanings).

    temperature 0 (or below GREEDY_TEMPERATURE) is greedy. top_k <= 0 (or >= the vocabulary) and
    top_p == 1 and min_p == 0 disable those filters. Every float must be finite.
    max_tokens None means "until the context (max_model_len) is full". `seed` makes the request's
    tokens reproducible whatever else shares the batch. `logprobs` / `prompt_logprobs` ask for that
    many top alternatives per token (plus the chosen token). `output_kind` "delta" makes each output
    carry only the tokens, text and logprobs that are new since the request's previous output (prompt
    logprobs in the first only). Invalid values raise ValueError naming the field, what it got and what
    is allowed.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # EOS and stop_token_ids cannot be drawn before this many output tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # The stop string that ended the output stays at its end (vLLM's include_stop_str_in_output).
    include_stop_str_in_output: bool = False
    # Constrained decoding: the output matches this grammar (tokens outside it are never drawn).
    guided: GuidedDecoding | None = None
    # Added to a token's logit before sampling (OpenAI's logit_bias), and the only tokens that may be drawn.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Requests share cached prefix KV blocks only with requests of the same salt (e.g. one per tenant).
    cache_salt: str | None = None
    output_kind: OutputKind = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k < 0:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (math.isfinite(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)}")
            for name in FLOAT_FIELDS
        ]
        checks += [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1 (or None for 'up to the context length'), got {self.max_tokens}",
            ),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}",
            ),
            (
                -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
                f"presence_penalty must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {self.presence_penalty}",
            ),
            (
                -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
                f"frequency_penalty must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {self.frequency_penalty}",
            ),
            (
                self.seed is None or 0 <= self.seed <= MAX_SEED,
                f"seed must be in [0, {MAX_SEED}] (or None), got {self.seed}",
            ),
            (all(s for s in self.stop or []), "stop strings must be non-empty"),
            (self.cache_salt is None or self.cache_salt != "", "cache_salt must be non-empty (or None)"),
            (
                self.output_kind in ("cumulative", "delta"),
                f"output_kind must be 'cumulative' or 'delta', got {self.output_kind!r}",
            ),
            (all(t >= 0 for t in self.stop_token_ids or []), "stop_token_ids must be >= 0"),
            (
                all(
                    t >= 0 and math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS
                    for t, b in (self.logit_bias or {}).items()
                ),
                f"logit_bias maps token ids >= 0 to finite values in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]",
            ),
            (
                self.allowed_token_ids is None
                or (bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0),
                "allowed_token_ids must be a non-empty list of token ids >= 0 (or None)",
            ),
        ]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            checks.append(
                (
                    value is None or 0 <= value <= MAX_LOGPROBS,
                    f"{name} must be between 0 and {MAX_LOGPROBS} (or None), got {value}",
                )
            )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


@dataclass
class Logprob:
    """One candidate token's log-probability under the model, its rank (1 = most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: token id -> Logprob for the top-k candidates and the token actually chosen.
PositionLogprobs = dict[int, Logprob]


class SequenceStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation stream: prompt + output tokens, how many of them are in the KV cache, and why it ended.

    `seq_id` is the request id for index 0 and "<request id>#<index>" for forked siblings (n > 1).
    `max_tokens` is the effective cap the scheduler resolved from the params and max_model_len.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    index: int = 0
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    max_tokens: int = 0
    max_model_len: int = 0
    num_forks_pending: int = 0
    num_preemptions: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        if self.index == 0:
            self.num_forks_pending = self.params.n - 1

    @property
    def seq_id(self) -> str:
        return self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def slots_needed(self) -> int:
        """Slots this sequence holds: itself plus the siblings it will fork into."""
        return 1 + self.num_forks_pending

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and finish the sequence if a stop condition holds."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            self.finish("stop")
        elif token_id in (self.params.stop_token_ids or ()):
            self.finish("stop", stop_reason=token_id)
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish("length")

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first `num_output_tokens` (a finished sequence's tokens after a
        stop string that speculative decoding had appended in the same step)."""
        del self.output_token_ids[num_output_tokens:]
        del self.token_ids[self.num_prompt_tokens + num_output_tokens :]

    def finish(
        self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None
    ) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def fork(self, index: int) -> Sequence:
        """A sibling with the same prompt, sharing nothing mutable with this one."""
        return Sequence(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            eos_token_ids=self.eos_token_ids,
            index=index,
            arrival_time=self.arrival_time,
            output_token_ids=list(self.output_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            max_tokens=self.max_tokens,
            max_model_len=self.max_model_len,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=self.cumulative_logprob,
        )
