"""The fixed benchmark workloads: random prompts of random lengths, each with an exact output length; a
share of them may carry a JSON schema (`with_schemas`) to measure what constrained decoding costs.

`mixed` (the default): prompts and outputs of 16-256 tokens. `long-prompts`: prefill-heavy, as
retrieval-augmented answers are: prompts of 1024-4096 tokens, 32-64 output tokens (needs a model whose
context holds 4160 tokens, e.g. builtin:smollm2 or builtin:llama-1b)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

NUM_REQUESTS = 64
SEED = 0
PROMPT_LENGTHS = (16, 256)
OUTPUT_LENGTHS = (16, 256)
# Tokens per KV block of the inflight engines the benchmarks run (the engine's default).
BLOCK_SIZE = 16
# Name -> (prompt lengths, output lengths), inclusive ranges.
WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "mixed": (PROMPT_LENGTHS, OUTPUT_LENGTHS),
    "long-prompts": ((1024, 4096), (32, 64)),
}
# The schema of a constrained request: an array of at least 64 small objects, which no output of
# OUTPUT_LENGTHS can finish (each item takes several tokens), so a constrained request generates exactly
# its output length, as the others do, while every token is masked by the schema's grammar.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "kind": {"enum": ["cat", "dog", "bird"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["name", "kind", "score"],
        "additionalProperties": False,
    },
}


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    # Exactly this many tokens are generated (end-of-sequence is ignored).
    output_len: int
    # A JSON schema the output must follow (None: unconstrained).
    schema: dict[str, Any] | None = None
    # How each token is chosen: 0 is greedy. Only `bench serve` samples (`with_sampling`): `bench offline`
    # compares the systems token for token, which needs greedy requests.
    temperature: float = 0.0
    top_p: float = 1.0


def special_token_ids(model_dir: Path) -> set[int]:
    """Token ids a random prompt must not contain: the tokenizer's added/special tokens and config's ids."""
    ids: set[int] = set()
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        for token in json.loads(tokenizer_file.read_text()).get("added_tokens", []):
            ids.add(int(token["id"]))
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = config.get(key)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
    return ids


def vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["vocab_size"])


def make_workload(
    vocab: int,
    excluded_ids: set[int],
    num_requests: int = NUM_REQUESTS,
    seed: int = SEED,
    prompt_lengths: tuple[int, int] = PROMPT_LENGTHS,
    output_lengths: tuple[int, int] = OUTPUT_LENGTHS,
) -> list[BenchRequest]:
    """`num_requests` requests, lengths uniform in the inclusive ranges, token ids uniform over the vocabulary
    minus `excluded_ids`. The same arguments give the same requests on every machine."""
    allowed = [i for i in range(vocab) if i not in excluded_ids]
    if not allowed:
        raise ValueError("the vocabulary has no ordinary tokens to build prompts from")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_lengths)
        output_len = rng.randint(*output_lengths)
        requests.append(BenchRequest([rng.choice(allowed) for _ in range(prompt_len)], output_len))
    return requests


def load_workload(
    model_dir: Path,
    num_requests: int = NUM_REQUESTS,
    seed: int = SEED,
    workload: str = "mixed",
    schema_share: float = 0.0,
) -> list[BenchRequest]:
    """The named fixed workload (WORKLOADS) over the vocabulary of the checkpoint in `model_dir`,
    `schema_share` of it constrained (`with_schemas`)."""
    prompt_lengths, output_lengths = WORKLOADS[workload]
    requests = make_workload(
        vocab_size(model_dir),
        special_token_ids(model_dir),
        num_requests,
        seed,
        prompt_lengths,
        output_lengths,
    )
    return with_schemas(requests, schema_share)


def longest_request(requests: Sequence[BenchRequest]) -> int:
    """The tokens of the workload's longest request, prompt and output: what one slot must hold."""
    return max(len(r.prompt_token_ids) + r.output_len for r in requests)


def kv_blocks_for(requests: Sequence[BenchRequest], max_slots: int) -> int:
    """The KV blocks an inflight engine is given for `requests`: the longest request's (prompt and output)
    in every slot that can be busy at once (as many as there are requests, at most `max_slots`), and one
    more, so that no request is ever preempted (the comparison is of batching, not of preemption). A pool
    for every slot where fewer requests run would hold memory nothing uses: for 8 long-prompt requests
    (the longest 3,805 tokens) 64 slots are 15,233 blocks, 14.9 GiB of float32 KV cache on llama-1b."""
    return min(max_slots, len(requests)) * math.ceil(longest_request(requests) / BLOCK_SIZE) + 1


def warmup_prompt(requests: Sequence[BenchRequest]) -> list[int]:
    """The prompt a system is warmed up on before its timed run: as long as the first request's (the same
    shapes), its tokens reversed and rotated until the first is one no request starts with (reversed only,
    where every one of its tokens starts some request: then at most that one token is shared). A prefix cache
    (vLLM's, inflight's) or llama-server's per-slot prompt cache then holds nothing the workload's prompts
    begin with, so no system skips part of a timed prompt's prefill (warmed up on request 0's own prompt,
    vLLM's offline run skipped that prompt's 2,601 of the long-prompt workload's 41,696 prompt tokens)."""
    tokens = list(reversed(requests[0].prompt_token_ids))
    firsts = {request.prompt_token_ids[0] for request in requests if request.prompt_token_ids}
    for shift in range(len(tokens)):
        if tokens[shift] not in firsts:
            return tokens[shift:] + tokens[:shift]
    return tokens


def checked_share(value: float) -> float:
    """`value` if it is a share of the requests (0-1), else ValueError."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"the schema share must be in [0, 1], got {value:g}")
    return value


def with_schemas(requests: list[BenchRequest], share: float) -> list[BenchRequest]:
    """The same requests, `share` of them (spread evenly: request i when floor((i + 1) * share) grows)
    carrying BENCH_SCHEMA."""
    checked_share(share)
    return [
        replace(request, schema=BENCH_SCHEMA) if int((i + 1) * share) > int(i * share) else request
        for i, request in enumerate(requests)
    ]


def checked_temperature(value: float) -> float:
    """`value` if it is a temperature the OpenAI API takes (0-2), else ValueError."""
    if not 0.0 <= value <= 2.0:
        raise ValueError(f"the temperature must be between 0 and 2, got {value:g}")
    return value


def checked_top_p(value: float) -> float:
    """`value` if it is a nucleus share (above 0, at most 1), else ValueError."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be above 0 and at most 1, got {value:g}")
    return value


def with_sampling(requests: list[BenchRequest], temperature: float, top_p: float) -> list[BenchRequest]:
    """The same requests, each sampled at `temperature` (0: greedy) from its `top_p` nucleus."""
    checked_temperature(temperature)
    checked_top_p(top_p)
    return [replace(request, temperature=temperature, top_p=top_p) for request in requests]


def sampling_name(temperature: float, top_p: float) -> str:
    """How `with_sampling` requests choose their tokens, in words: "greedy", "temperature 0.8, top_p 0.9"."""
    if temperature == 0.0:
        return "greedy"
    return f"temperature {temperature:g}" + (f", top_p {top_p:g}" if top_p < 1.0 else "")
