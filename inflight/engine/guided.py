"""Constrained (guided) decoding: grammars from llguidance, one matcher per sequence, token bitmasks.

A request's `SamplingParams.guided` names what its output must match (a JSON schema, any JSON object, a
regular expression, one of a list of strings, a Lark grammar). `GrammarCompiler` turns it into an
llguidance grammar once per distinct spec (a bounded LRU of ready matchers; each sequence gets a copy),
and says why when it cannot (`GrammarError`, for the server's 400). `GrammarMatchers` keeps one matcher
per sequence, keyed by (request id, sequence index), and brings it up to date with the sequence's output
tokens before each mask: its state is a function of the output alone, so preemption (recompute), forks
(n > 1) and seeded sampling need nothing else. Masks of a step's grammar rows are computed by
llguidance's thread pool (parallel across requests on the cores torch leaves free, without the GIL)
while the model runs the forward pass (`ModelRunner` starts them first), packed 32 tokens to an int32
word; `apply_token_bitmask` puts them on the logits in one pass.

llguidance over xgrammar (both measured on SmolLM2's 49152-token vocabulary, docs/api.md): it builds
its parser lazily, so a new schema costs about 1 ms instead of xgrammar's ahead-of-time mask tables
(15 ms for a small schema, far more for large ones, which is what a compile time limit has to guard
against); it bounds grammar size and parser work itself (`LLParserLimits`); it needs no transformers,
triton or torch at runtime (the engine reads tokenizers without transformers); its per-token mask
(about 0.09 ms) is well under a decode step.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import torch

from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.cpu_limit import usable_cpus
from inflight.engine.errors import ConstraintFailure, GrammarError
from inflight.engine.sequence import GuidedDecoding
from inflight.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

GRAMMAR_CACHE_SIZE = 256  # distinct specs kept ready
MAX_SPEC_CHARS = 1 << 20  # a schema / grammar text larger than this is refused before compiling
# The JSON the model writes: json.dumps' separators, no free whitespace (a model cannot pad forever).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_GRAMMAR_SIZE = 500_000  # llguidance's grammar-size limit (symbols after expansion)
# Keywords whose value maps names to schemas (not a schema itself).
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar of a spec; raises GrammarError for what is malformed before compiling."""
    if len(guided.value) > MAX_SPEC_CHARS:
        raise GrammarError(f"the {guided.kind} is {len(guided.value)} characters; at most {MAX_SPEC_CHARS}")
    try:
        if guided.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        if guided.kind == "json_schema":
            options: JsonCompileOptions = {**JSON_OPTIONS, "lenient": not guided.strict}
            schema = closed_objects(json.loads(guided.value)) if guided.strict else guided.value
            return llguidance.LLMatcher.grammar_from_json_schema(schema, options)
        if guided.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(guided.value)
        if guided.kind == "choice":
            choices = json.loads(guided.value)
            lark = "start: " + " | ".join(json.dumps(c) for c in choices)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.LLMatcher.grammar_from_lark(guided.value)
    except (ValueError, TypeError) as error:
        raise GrammarError(str(error)) from error


def closed_objects(schema: Any) -> Any:
    """A JSON schema where every object schema that does not say `additionalProperties` (nor
    `patternProperties`) has `additionalProperties: false`: OpenAI's strict mode, where an answer holds
    the properties the schema names and no others (a small model otherwise invents keys until
    max_tokens)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {
        key: {name: closed_objects(sub) for name, sub in value.items()}
        if key in NAMED_SCHEMAS and isinstance(value, dict)
        else closed_objects(value)
        for key, value in schema.items()
    }
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


class GrammarCompiler:
    """Specs -> ready llguidance matchers, once per distinct spec (an LRU of GRAMMAR_CACHE_SIZE).

    Thread-safe: the server compiles in its worker threads, the engine copies matchers in its own."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GuidedDecoding, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled_total = 0  # specs compiled (cache misses), for tests and metrics

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first grammar (about 0.4 s for a 49k vocabulary), not at engine start."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._lltokenizer

    def compile(self, guided: GuidedDecoding) -> llguidance.LLMatcher:
        """The spec's ready matcher (shared: copy it with `deep_copy()`); raises GrammarError."""
        with self._lock:
            ready = self._cache.get(guided)
            if ready is not None:
                self._cache.move_to_end(guided)
                return ready
        text = grammar_text(guided)
        limits = llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0, limits=limits)
        # The first mask, on a copy: a grammar that admits no output fails here, not in the engine.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        for state in (matcher, probe):
            if state.is_error():
                raise GrammarError(state.get_error().splitlines()[0])
        if guided.kind in ("json_schema", "json_object") and matcher.is_accepting():
            raise GrammarError("the schema admits no JSON value")  # an empty output is no JSON
        with self._lock:
            self.compiled_total += 1
            self._cache[guided] = matcher
            self._cache.move_to_end(guided)
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher


@dataclass
class _Matcher:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens fed to it


class GrammarMatchers:
    """One matcher per guided sequence, kept in step with its output tokens; a step's masks.

    `masks()` runs on the mask thread, `release()` on the engine thread: a lock keeps them apart."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, dict[int, _Matcher]] = {}  # request id -> sequence index -> matcher
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()

    def _synced(self, request_id: str, index: int, guided: GuidedDecoding, output: list[int]) -> _Matcher:
        matchers = self._matchers.setdefault(request_id, {})
        state = matchers.get(index)
        if state is None:
            state = matchers[index] = _Matcher(self.compiler.compile(guided).deep_copy())
        if state.consumed < len(output):
            state.matcher.consume_tokens(output[state.consumed :])
            state.consumed = len(output)
        return state

    def masks(
        self, rows: list[tuple[str, int, GuidedDecoding, list[int]]]
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """The allowed tokens of rows of (request id, sequence index, spec, output tokens so far) as int32
        bitmasks [len(rows), ceil(vocab / 32)] (bit j of word w: token 32 * w + j), and the rows that
        cannot draw with why (their grammar failed, or allows no token)."""
        words = (self.compiler.vocab_size + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        failed: dict[int, str] = {}
        ready: list[tuple[llguidance.LLMatcher, int]] = []
        with self._lock:
            for i, (request_id, index, guided, output) in enumerate(rows):
                try:
                    state = self._synced(request_id, index, guided, output)
                except GrammarError as error:
                    failed[i] = ConstraintFailure(f"the grammar cannot be used: {error}")
                    continue
                if state.matcher.is_error():
                    failed[i] = ConstraintFailure(
                        f"the output left its grammar: {state.matcher.get_error().splitlines()[0]}"
                    )
                else:
                    ready.append((state.matcher, i))
            if ready:
                if self._executor is None:
                    self._executor = llguidance.LLExecutor(mask_threads())
                self._executor.unsafe_compute_mask_ptr(ready, bitmask.data_ptr(), words * 4, len(rows))
            for matcher, i in ready:
                if matcher.is_error():  # the grammar has no way forward from here
                    failed[i] = ConstraintFailure(
                        f"the grammar failed: {matcher.get_error().splitlines()[0]}"
                    )
        for i in (bitmask == 0).all(dim=1).nonzero()[:, 0].tolist():
            failed.setdefault(i, ConstraintFailure("no token may be drawn: its grammar allows none"))
        return bitmask, failed

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's matchers."""
        with self._lock:
            self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        """Sequences holding a matcher."""
        with self._lock:
            return sum(len(m) for m in self._matchers.values())


def mask_threads() -> int:
    """llguidance's mask threads: the usable CPUs (cpu/cpu_limit.py) that torch's threads leave free, at
    least one. The masks run while the forward pass does (engine/constraints.py), so more threads than free
    cores only take turns with the forward's."""
    return max(1, usable_cpus() - torch.get_num_threads())


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every token of `logits` row rows[i] that bitmask row i does not allow.

    One C pass over the packed words on CPU (a word of 32 allowed tokens is skipped); elsewhere, or
    without the kernels, the bitmask unpacked to bool (`allowed_tokens`) and a masked fill."""
    if not rows:
        return
    vocab = logits.shape[1]
    library = cpu_kernels.library_for(logits)
    if library is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        index = torch.tensor(rows, dtype=torch.int64)
        bitmask = bitmask.contiguous()
        library.apply_token_bitmask(
            logits.data_ptr(), logits.stride(0), index.data_ptr(), bitmask.data_ptr(), len(rows),
            bitmask.shape[1], vocab, torch.get_num_threads(),
        )  # fmt: skip
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    allowed = allowed_tokens(bitmask, vocab).to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


# Bit k of a byte, for every byte value: bitmasks are unpacked a byte at a time (10x torch's shifts).
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from int32 bitmasks (bit j of word w = token 32 * w + j; little-endian, so
    byte b of the row holds tokens 8 * b .. 8 * b + 7)."""
    rows = bitmask.shape[0]
    bits = _BYTE_BITS[bitmask.contiguous().view(torch.uint8).long()]
    return bits.reshape(rows, -1)[:, :vocab_size]
