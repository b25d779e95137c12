"""Constrained decoding in the engine: grammar masks, logit_bias, allowed_token_ids, with continuous
batching, n > 1, seeds, preemption (recompute) and logprobs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.errors import GrammarError
from inflight.engine.guided import allowed_tokens, apply_token_bitmask, closed_objects
from inflight.engine.sequence import GuidedDecoding

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "kind", "ok", "tags"],
    "additionalProperties": False,
}
GUIDED = GuidedDecoding("json_schema", json.dumps(SCHEMA))
PROMPTS = ["def main(", "import os\nimport sys", "class Foo:\n    def", "x = 1"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(tiny_llama_dir, num_kv_blocks=128, max_slots=8, device="cpu")


def guided(**kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=80, guided=GUIDED, **kwargs)  # type: ignore[arg-type]


def test_outputs_validate_with_n_seeds_and_a_mixed_batch(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain)
    params = [guided(n=3, temperature=1.0, seed=7), plain, guided(temperature=0.8), plain]
    outputs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], params)
    for output in (outputs[0], outputs[2]):
        for choice in output.outputs:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), SCHEMA)
    # Unconstrained requests draw exactly what they draw alone.
    assert outputs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outputs[3].outputs[0].token_ids == alone[1].outputs[0].token_ids
    # Seeded constrained requests are reproducible whatever shares the batch.
    again = llm.generate([PROMPTS[0]], guided(n=3, temperature=1.0, seed=7))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outputs[0].outputs]
    assert len(llm.engine.runner.constraints.grammars) == 0  # finished requests left no matcher behind


def test_grammars_compile_once_per_distinct_spec(llm: LLM) -> None:
    compiler = llm.engine.grammars
    regex = GuidedDecoding("regex", "[a-c]{2,4}!")
    before = compiler.compiled_total
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, guided=regex, temperature=1.0))
    assert compiler.compiled_total == before + 1
    for output in outputs:
        text = output.outputs[0].text
        assert 3 <= len(text) <= 5 and set(text[:-1]) <= set("abc") and text.endswith("!"), text


def test_preempted_guided_sequences_recompute_valid_output(tiny_llama_dir: Path) -> None:
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    params = [guided(temperature=0.9, seed=i) for i in range(6)]
    roomy = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=8, max_slots=8, device="cpu")
    tight = LLM(tiny_llama_dir, num_kv_blocks=20, block_size=8, max_slots=8, device="cpu")
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    for want, have in zip(expected, got, strict=True):
        jsonschema.validate(json.loads(have.outputs[0].text), SCHEMA)
        assert have.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_cached_prefix_leaves_constrained_output_unchanged(tiny_llama_dir: Path) -> None:
    """Constrained requests whose prompts share blocks already in the prefix cache (left by a plain
    request and by a constrained one) decode as they do with no cache: valid, and greedy identical."""
    shared = list(range(5, 5 + 4 * 8))  # four full blocks
    prompts = [[*shared, 100 + i, 200 + i] for i in range(3)]
    params = guided(temperature=0.0)
    settings = {"num_kv_blocks": 128, "block_size": 8, "max_slots": 8, "device": "cpu"}
    uncached = LLM(tiny_llama_dir, enable_prefix_caching=False, **settings)
    expected = [uncached.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    cached = LLM(tiny_llama_dir, **settings)
    cached.generate([[*shared, 7]], SamplingParams(max_tokens=4, temperature=0.0))  # a plain request first
    got = [cached.generate([prompt], params)[0].outputs[0] for prompt in prompts]
    assert cached.engine.stats().num_prefix_cache_hits >= 3 * len(shared)
    for want, have in zip(expected, got, strict=True):
        jsonschema.validate(json.loads(have.text), SCHEMA)
        assert have.token_ids == want


def test_logprobs_are_of_the_constrained_distribution(llm: LLM) -> None:
    choice = GuidedDecoding("choice", json.dumps(["yes", "no"]))
    output = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, guided=choice, logprobs=5))[0].outputs[0]
    assert output.text in ("yes", "no")
    assert output.logprobs is not None
    first = output.logprobs[0]
    tokenizer = llm.engine.tokenizer
    # Every alternative with a probability is a way to start "yes" or "no" (raw logprobs would list the
    # model's favourite tokens), and their probabilities are those of the constrained distribution.
    allowed = {t: lp.logprob for t, lp in first.items() if math.isfinite(lp.logprob)}
    for token_id in allowed:
        text = tokenizer.decode([token_id])
        assert text and ("yes".startswith(text) or "no".startswith(text)), text
    assert sum(math.exp(v) for v in allowed.values()) <= 1 + 1e-4
    assert len(allowed) < len(first) or len(first) <= 5


def test_logit_bias_and_allowed_token_ids(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    free = llm.generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids
    forced = llm.generate([PROMPTS[0]], SamplingParams(**{**vars(greedy), "logit_bias": {77: 100.0}}))
    assert forced[0].outputs[0].token_ids == [77] * 6
    banned = llm.generate([PROMPTS[0]], SamplingParams(**{**vars(greedy), "logit_bias": {free[0]: -100.0}}))
    assert banned[0].outputs[0].token_ids[0] != free[0]
    allowed = [5, 9, 300]
    sampled = llm.generate(
        [PROMPTS[0]],
        SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True, allowed_token_ids=allowed),
    )
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize(
    "spec",
    [
        GuidedDecoding("json_schema", json.dumps({"type": "string", "minLength": 5, "maxLength": 2})),
        GuidedDecoding("json_schema", json.dumps({"type": "string", "pattern": "(["})),
        GuidedDecoding("json_schema", json.dumps({"not": {}})),
        GuidedDecoding("json_schema", "{not json"),
        GuidedDecoding("regex", "(unclosed"),
        GuidedDecoding("lark", "start: undefined_rule"),
    ],
)
def test_unusable_grammars_are_refused_when_added(llm: LLM, spec: GuidedDecoding) -> None:
    with pytest.raises(GrammarError):
        llm.engine.add_request("bad", "x", SamplingParams(guided=spec))
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_with_no_allowed_token_fails_only_its_request(llm: LLM) -> None:
    # min_tokens forbids EOS, the grammar allows nothing else once "a" is written.
    params = [
        SamplingParams(max_tokens=5, min_tokens=3, guided=GuidedDecoding("regex", "a")),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    ]
    failed, fine = llm.generate(["x", "y"], params)
    assert failed.outputs[0].finish_reason == "error" and "no token may be drawn" in (failed.error or "")
    assert fine.outputs[0].finish_reason == "length"


def test_strict_schemas_close_objects_that_do_not_say() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "$defs": {"open": {"type": "object", "additionalProperties": True}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    inner = closed["properties"]["properties"]
    assert inner["additionalProperties"] is False and "additionalProperties" not in inner["properties"]
    assert closed["$defs"]["open"]["additionalProperties"] is True


def test_a_strict_schema_allows_no_extra_keys(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    strict = GuidedDecoding("json_schema", json.dumps(schema), strict=True)
    lax = GuidedDecoding("json_schema", json.dumps(schema), strict=False)
    matcher = llm.engine.grammars.compile(strict).deep_copy()
    assert not matcher.consume_tokens(llm.engine.tokenizer.encode('{"a": 1, "b"', add_special_tokens=False))
    matcher = llm.engine.grammars.compile(lax).deep_copy()
    assert matcher.consume_tokens(llm.engine.tokenizer.encode('{"a": 1, "b"', add_special_tokens=False))


def test_bitmasks_unpack_bit_j_of_word_w_to_token_32w_plus_j() -> None:
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 10), dtype=torch.int32)
    shifts = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    assert torch.equal(allowed_tokens(bitmask, 300), shifts.reshape(3, -1)[:, :300].bool())


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernel", "torch"])
def test_bitmasks_limit_only_their_rows_to_their_allowed_tokens(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "library_for", lambda *tensors: None)
    elif cpu_kernels.library_for(torch.zeros(1)) is None:
        pytest.skip("the C kernels are not available here")
    vocab = 300  # not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 10), dtype=torch.int32)
    bitmask[0, 3] = -1  # 32 allowed tokens in one word (skipped by the kernel)
    bitmask[1, 4] = 0
    logits = torch.randn(5, vocab)
    limited = logits.clone()
    apply_token_bitmask(limited, [3, 0], bitmask)
    allowed = allowed_tokens(bitmask, vocab)
    assert torch.equal(limited[3], logits[3].masked_fill(~allowed[0], float("-inf")))
    assert torch.equal(limited[0], logits[0].masked_fill(~allowed[1], float("-inf")))
    assert torch.equal(limited[[1, 2, 4]], logits[[1, 2, 4]])  # rows without a grammar: bit for bit
