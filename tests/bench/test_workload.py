"""The fixed offline workload: deterministic, within its ranges, free of special tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from inflight.bench.workload import (
    BENCH_SCHEMA,
    BLOCK_SIZE,
    BenchRequest,
    kv_blocks_for,
    load_workload,
    make_workload,
    sampling_name,
    special_token_ids,
    warmup_prompt,
    with_sampling,
    with_schemas,
)


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    first = make_workload(vocab=1000, excluded_ids={0, 1}, num_requests=8, seed=0)
    assert first == make_workload(vocab=1000, excluded_ids={0, 1}, num_requests=8, seed=0)
    assert first != make_workload(vocab=1000, excluded_ids={0, 1}, num_requests=8, seed=1)


def test_lengths_in_range_and_no_excluded_ids() -> None:
    excluded = {0, 1, 2, 999}
    requests = make_workload(vocab=1000, excluded_ids=excluded, num_requests=64, seed=0)
    assert len(requests) == 64
    for request in requests:
        assert 16 <= len(request.prompt_token_ids) <= 256
        assert 16 <= request.output_len <= 256
        assert not excluded & set(request.prompt_token_ids)
        assert all(0 <= t < 1000 for t in request.prompt_token_ids)
    # Uniform over the range: both ends of it are reachable, not a constant length.
    assert len({r.output_len for r in requests}) > 30


def test_special_tokens_of_a_checkpoint_are_excluded(tiny_llama_dir: Path) -> None:
    specials = special_token_ids(tiny_llama_dir)
    assert {0, 1, 2} <= specials  # bos, eos, pad of the generated checkpoint
    requests = load_workload(tiny_llama_dir, num_requests=16)
    assert all(not specials & set(r.prompt_token_ids) for r in requests)


def test_long_prompts_workload_is_prefill_heavy(tiny_llama_dir: Path) -> None:
    requests = load_workload(tiny_llama_dir, num_requests=16, workload="long-prompts")
    assert all(1024 <= len(r.prompt_token_ids) <= 4096 and 32 <= r.output_len <= 64 for r in requests)
    assert load_workload(tiny_llama_dir, 16) != requests


def test_the_warm_up_prompt_starts_no_prompt_of_the_workload() -> None:
    requests = make_workload(vocab=1000, excluded_ids=set(), num_requests=64, seed=0)
    prompt = warmup_prompt(requests)
    # As long as request 0's prompt and made of its tokens (the warm-up step's shapes and vocabulary).
    assert sorted(prompt) == sorted(requests[0].prompt_token_ids)
    # No cache a warm-up fills can give a timed prompt its first token, let alone a 16-token block.
    assert all(prompt[0] != r.prompt_token_ids[0] for r in requests)


def test_the_warm_up_prompt_rotates_past_tokens_that_start_other_prompts() -> None:
    requests = [BenchRequest([5, 6, 7, 8], 4), BenchRequest([8, 1], 4), BenchRequest([7, 2], 4)]
    # Reversed, request 0's prompt would start with 8, rotated once with 7: each starts another prompt.
    assert warmup_prompt(requests) == [6, 5, 8, 7]


def test_a_schema_share_marks_requests_evenly() -> None:
    requests = make_workload(vocab=100, excluded_ids=set(), num_requests=8, seed=0)
    half = with_schemas(requests, 0.5)
    assert [r.schema is not None for r in half] == [False, True] * 4
    assert [(r.prompt_token_ids, r.output_len) for r in half] == [
        (r.prompt_token_ids, r.output_len) for r in requests
    ]
    assert all(r.schema is None for r in with_schemas(requests, 0.0))
    assert all(r.schema == BENCH_SCHEMA for r in with_schemas(requests, 1.0))
    assert sum(r.schema is not None for r in with_schemas(requests, 0.25)) == 2
    with pytest.raises(ValueError, match="schema share"):
        with_schemas(requests, 1.5)


def test_sampled_requests_keep_their_prompts_and_lengths() -> None:
    requests = with_schemas(make_workload(vocab=100, excluded_ids=set(), num_requests=4, seed=0), 0.5)
    sampled = with_sampling(requests, 0.8, 0.95)
    assert [(r.temperature, r.top_p) for r in sampled] == [(0.8, 0.95)] * 4
    assert [(r.prompt_token_ids, r.output_len, r.schema) for r in sampled] == [
        (r.prompt_token_ids, r.output_len, r.schema) for r in requests
    ]
    assert [(r.temperature, r.top_p) for r in requests] == [(0.0, 1.0)] * 4  # greedy unless asked
    assert sampling_name(0.0, 1.0) == "greedy"
    assert sampling_name(0.8, 1.0) == "temperature 0.8"
    assert sampling_name(0.8, 0.95) == "temperature 0.8, top_p 0.95"


@pytest.mark.parametrize(
    ("temperature", "top_p", "message"),
    [(2.5, 1.0, "temperature must be between 0 and 2, got 2.5"), (-0.1, 1.0, "got -0.1"),
     (1.0, 0.0, "top_p must be above 0 and at most 1, got 0"), (1.0, 1.5, "got 1.5")],
)  # fmt: skip
def test_sampling_outside_the_apis_ranges_is_refused(temperature: float, top_p: float, message: str) -> None:
    requests = make_workload(vocab=100, excluded_ids=set(), num_requests=1, seed=0)
    with pytest.raises(ValueError, match=message):
        with_sampling(requests, temperature, top_p)


def test_the_kv_pool_holds_the_longest_request_in_every_slot_that_can_be_busy() -> None:
    """As many slots as can run at once (the requests, at most max_slots) times the longest request's
    blocks, and one more: 8 long requests get 8 slots' worth, not 64 (15 GiB of float32 KV on llama-1b)."""
    requests = [BenchRequest([1] * prompt, output) for prompt, output in ((4096, 64), (1024, 32), (100, 8))]
    longest_blocks = math.ceil((4096 + 64) / BLOCK_SIZE)
    assert kv_blocks_for(requests, max_slots=64) == 3 * longest_blocks + 1
    assert kv_blocks_for(requests, max_slots=2) == 2 * longest_blocks + 1
    assert kv_blocks_for(requests[2:], max_slots=64) == math.ceil(108 / BLOCK_SIZE) + 1
