"""Speculative decoding (n-gram prompt lookup): proposals, KV rollback, and outputs identical to decoding
without it: greedy against transformers, and seeded sampling, n > 1, stop strings, max_tokens,
preemption and logprobs against the same engine without speculation."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.kv_cache import KVCacheManager
from inflight.engine.output_processor import RequestOutput
from inflight.engine.scheduler import StepRecord
from inflight.engine.sequence import SamplingParams
from inflight.engine.speculative import lookup

from support.reference import hf_greedy

BLOCK_SIZE = 8


def repeating_prompts(vocab_size: int, count: int = 8) -> list[list[int]]:
    """Prompts made of a repeated segment (plus a random tail), so proposals are made, some accepted."""
    rng = random.Random(29)
    prompts = []
    for _ in range(count):
        segment = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 10))]
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 4))]
        prompts.append(segment * rng.randrange(2, 6) + tail)
    return prompts


def engine(model_dir: Path, speculative: bool, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {"block_size": BLOCK_SIZE, "dtype": "float32", "device": "cpu", **overrides}
    if speculative:
        settings.setdefault("speculative_max_running", 64)
        settings["speculative"] = "ngram"
    return LLMEngine(model_dir, EngineConfig(**settings))


def run(
    model_dir: Path, prompts: list[Any], params: list[SamplingParams], speculative: bool, **overrides: Any
) -> tuple[list[RequestOutput], LLMEngine]:
    eng = engine(model_dir, speculative, **overrides)
    outputs = eng.generate(prompts, params)
    assert eng.kv_cache.num_used_blocks == 0
    eng.kv_cache.check_consistency()
    return outputs, eng


def completions(outputs: list[RequestOutput]) -> list[list[tuple[list[int], str, str | None, Any]]]:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


# ---- the proposer


def test_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # Suffix [2, 3] last occurred at 5..6, followed by 7, 8, 5.
    assert lookup(tokens, 2, 4, 3) == [7, 8, 5]
    assert lookup(tokens, 2, 4, 1) == [7]
    # [5, 2, 3] never occurred before; with ngram_min 3 nothing is proposed.
    assert lookup(tokens, 3, 4, 3) == []
    # The longer match wins over a later shorter one: [9, 1] ... [x, 1] only matches with n = 1.
    assert lookup([4, 1, 5, 6, 1, 7, 4, 1], 1, 2, 2) == [5, 6]
    assert lookup([1, 2], 1, 3, 4) == []
    assert lookup([1, 1], 1, 3, 4) == [1]


def test_truncate_frees_blocks_past_the_kept_tokens() -> None:
    kv = KVCacheManager(8, 4)
    kv.match_prefix("a", [])
    assert kv.allocate("a", 0, 10)
    assert len(kv.block_table("a")) == 3
    kv.truncate("a", 5)
    assert len(kv.block_table("a")) == 2 and kv.num_used_blocks == 2
    kv.truncate("a", 8)
    assert len(kv.block_table("a")) == 2
    kv.check_consistency()


# ---- greedy: identical to transformers


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(f"tiny_{request.param}_dir")
    return path


def test_greedy_equals_transformers(model_dir: Path) -> None:
    from inflight.engine.model.config import ModelConfig

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = repeating_prompts(vocab)
    # A tiny random model may repeat one token forever: put that token, twice, in front of another one in
    # the prompt too, so that some proposals are wrong.
    firsts = hf_greedy(model_dir, prompts, [1] * len(prompts))
    prompts = [[f[0], f[0], (f[0] + 1) % vocab, *p] for f, p in zip(firsts, prompts, strict=True)]
    max_tokens = [random.Random(i).randrange(1, 40) for i in range(len(prompts))]
    expected = hf_greedy(model_dir, prompts, max_tokens)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    drafted = accepted = 0
    for overrides in (
        {"max_num_seqs": 8},
        {"max_num_seqs": 8, "num_kv_blocks": 20, "enable_prefix_caching": False},  # preemption
        {"max_num_seqs": 3, "max_num_batched_tokens": 16, "num_speculative_tokens": 7},
        {"max_num_seqs": 8, "ngram_min": 1, "ngram_max": 1},  # more proposals, more of them wrong
    ):
        outputs, eng = run(model_dir, prompts, params, True, **overrides)
        assert [o.outputs[0].token_ids for o in outputs] == expected, overrides
        # Never past max_tokens.
        assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
        stats = eng.stats()
        assert stats.num_accepted_tokens > 0, overrides
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        if "num_kv_blocks" in overrides:
            assert stats.num_preemptions > 0
    assert accepted < drafted  # some proposals were rejected (their KV rolled back)


# ---- the rest against the same engine without speculation


def test_seeded_sampling_n_and_logprobs_unchanged(tiny_llama_dir: Path) -> None:
    prompts: list[Any] = repeating_prompts(1000, 4)
    params = [
        SamplingParams(
            max_tokens=24, temperature=(0.02, 0.5)[i % 2], seed=i, ignore_eos=True, n=1 + i % 3, logprobs=2
        )
        for i in range(len(prompts))
    ]
    off, _ = run(tiny_llama_dir, prompts, params, False, max_num_seqs=16)
    on, eng = run(tiny_llama_dir, prompts, params, True, max_num_seqs=16, ngram_min=1)
    assert completions(on) == completions(off)
    for a, b in zip(on, off, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.logprobs is not None and y.logprobs is not None
            assert [sorted(p) for p in x.logprobs] == [sorted(p) for p in y.logprobs]
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
    assert eng.stats().num_accepted_tokens > 0


def test_stop_strings_and_stop_tokens_end_where_they_did(tiny_llama_dir: Path) -> None:
    prompts = repeating_prompts(1000, 6)
    greedy = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 6
    free, eng = run(tiny_llama_dir, prompts, greedy, False, max_num_seqs=8)
    params = []
    for i, output in enumerate(free):
        tokens = output.outputs[0].token_ids
        # Four tokens of the first run of one token repeated 6+ times: their text first appears when the
        # run's fourth token is emitted, a proposal accepted with a token after it in the same step.
        run_start = next((r for r in range(len(tokens) - 5) if len(set(tokens[r : r + 6])) == 1), 0)
        stop = eng.tokenizer.decode(tokens[run_start : run_start + 4]) or "x"
        params.append(
            SamplingParams(
                max_tokens=30,
                temperature=0.0,
                ignore_eos=True,
                stop=[stop],
                stop_token_ids=[tokens[-1]] if i % 2 else None,
                include_stop_str_in_output=i % 3 == 0,
            )
        )
    off, _ = run(tiny_llama_dir, prompts, params, False, max_num_seqs=8)
    on, eng = run(tiny_llama_dir, prompts, params, True, max_num_seqs=8)
    assert completions(on) == completions(off)
    assert {o.outputs[0].finish_reason for o in off} == {"stop"}
    assert eng.stats().num_accepted_tokens > 0


def test_off_when_more_sequences_run_than_the_limit(tiny_llama_dir: Path) -> None:
    prompts = repeating_prompts(1000, 6)
    # Four finish early; the last two run on alone.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 4, 5, 6, 30, 30)]
    records: list[StepRecord] = []
    eng = engine(tiny_llama_dir, True, max_num_seqs=8, speculative_max_running=2)
    eng.scheduler.on_step = records.append
    eng.generate(prompts, params)
    # A step computes more than one token of a running sequence only while at most 2 sequences run.
    running: set[str] = set()
    for record in records:
        before = set(running)
        running |= set(record.admitted)
        speculated = [sid for sid, n in record.scheduled if n > 1 and sid in before]
        if len(before) > 2:
            assert not speculated, record
        running -= set(record.finished) | set(record.preempted)
    assert eng.stats().num_draft_tokens > 0


def test_metrics_expose_proposed_and_accepted_tokens() -> None:
    from prometheus_client import generate_latest

    from inflight.engine.stats import EngineStats
    from inflight.server.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: EngineStats(num_draft_tokens=40, num_accepted_tokens=25))
    text = generate_latest(metrics.registry).decode()
    assert "inflight:spec_decode_num_draft_tokens_total 40.0" in text
    assert "inflight:spec_decode_num_accepted_tokens_total 25.0" in text


def test_requests_with_a_grammar_do_not_speculate(tiny_llama_dir: Path) -> None:
    from inflight.engine.sequence import GuidedDecoding

    prompts: list[Any] = repeating_prompts(1000, 2)
    guided = GuidedDecoding("regex", "(ab){3,30}")
    params = [SamplingParams(max_tokens=20, temperature=0.0, guided=guided)] * 2
    off, _ = run(tiny_llama_dir, prompts, params, False)
    on, eng = run(tiny_llama_dir, prompts, params, True)
    assert completions(on) == completions(off)
    assert eng.stats().num_draft_tokens == 0
