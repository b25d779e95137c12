"""The fixed offline workload: deterministic, within its ranges, free of special tokens."""

from __future__ import annotations

from pathlib import Path

from inflight.bench.workload import load_workload, make_workload, special_token_ids


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
