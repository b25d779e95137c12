"""The contiguous KV allocator: consecutive block ids reserved up front, first fit, freed whole."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from inflight.engine.config import ContiguousReserve, EngineConfig
from inflight.engine.contiguous_kv import ContiguousKVCache, reservation_tokens
from inflight.engine.engine import LLMEngine
from inflight.engine.sequence import SamplingParams


def test_a_request_reserves_its_whole_region_up_front_and_writes_into_it() -> None:
    cache = ContiguousKVCache(10, 4, lambda seq_id: 13)  # 13 tokens: 4 blocks of 4
    assert cache.allocate("a", 0, 5)
    assert cache.block_table("a") == [0, 1]
    assert (cache.reserved_tokens, cache.written_tokens) == (16, 5)
    assert cache.stats().num_used_blocks == 4 and cache.stats().num_free_blocks == 6
    assert cache.allocate("a", 5, 6)
    assert cache.block_table("a") == [0, 1, 2]
    assert cache.allocate("b", 0, 1)
    assert cache.block_table("b") == [4]  # the next free run, right after a's whole region
    with pytest.raises(ValueError, match="reserved 16"):
        cache.allocate("a", 16, 1)
    cache.truncate("a", 4)
    assert cache.block_table("a") == [0] and cache.reserved_tokens == 32
    cache.free("a")
    cache.free("b")
    assert (cache.reserved_tokens, cache.written_tokens, cache.block_table("a")) == (0, 0, [])


def test_free_space_split_into_holes_is_not_one_region() -> None:
    sizes = {"a": 4, "b": 3, "c": 3, "d": 6}
    cache = ContiguousKVCache(10, 1, sizes.__getitem__)
    assert cache.allocate("a", 0, 1) and cache.allocate("b", 0, 1) and cache.allocate("c", 0, 1)
    cache.free("a")
    cache.free("c")
    assert cache.holes() == [(0, 4), (7, 3)]
    assert not cache.allocate("d", 0, 1)  # 7 blocks free, but no 6 in a row
    assert not cache.holds("d")
    cache.free("b")
    assert cache.allocate("d", 0, 1)
    assert cache.holes() == [(6, 4)]


def test_first_fit_takes_the_lowest_hole_that_holds_the_region() -> None:
    sizes = {"a": 3, "b": 4, "c": 2, "d": 2, "e": 2, "f": 2}
    cache = ContiguousKVCache(13, 1, sizes.__getitem__)
    for seq in "abcd":
        assert cache.allocate(seq, 0, 1)
    cache.free("a")  # a hole of 3 at 0
    cache.free("c")  # a hole of 2 at 7 (a best fit would take it)
    assert cache.allocate("e", 0, 1)
    assert cache.block_table("e") == [0]
    assert cache.allocate("f", 0, 1)
    assert cache.block_table("f") == [7]


def test_random_reservations_never_overlap_or_exceed_the_pool() -> None:
    rng = random.Random(7)
    sizes: dict[str, int] = {}
    block_size = 4
    cache = ContiguousKVCache(125, block_size, sizes.__getitem__)
    written: dict[str, int] = {}
    for index in range(2000):
        if written and rng.random() < 0.4:
            victim = rng.choice(sorted(written))
            cache.free(victim)
            del written[victim]
        elif written and rng.random() < 0.5:
            seq = rng.choice(sorted(written))
            if written[seq] < sizes[seq]:
                assert cache.allocate(seq, written[seq], 1)
                written[seq] += 1
        else:
            seq = f"s{index}"
            sizes[seq] = rng.randint(1, 120)
            holes = cache.holes()
            fits = [start for start, length in holes if length * block_size >= sizes[seq]]
            assert cache.allocate(seq, 0, 1) == bool(fits)
            if fits:
                written[seq] = 1
                assert cache.block_table(seq) == [fits[0]]  # first fit
        cache.check_consistency()
        for seq, tokens in written.items():
            table = cache.block_table(seq)
            assert table == list(range(table[0], table[0] + -(-tokens // block_size)))  # consecutive
        assert cache.reserved_tokens <= cache.num_blocks * block_size
        assert cache.written_tokens == sum(written.values()) <= cache.reserved_tokens


def test_the_reservation_rule() -> None:
    assert reservation_tokens("max_model_len", 512, 40, 20) == 512
    assert reservation_tokens("prompt_plus_max_tokens", 512, 40, 20) == 60


def test_the_engine_config_rejects_what_contiguous_memory_cannot_do() -> None:
    with pytest.raises(ValidationError, match="enable_prefix_caching=False"):
        EngineConfig(kv_allocator="contiguous")
    with pytest.raises(ValidationError, match="speculative decoding"):
        EngineConfig(kv_allocator="contiguous", enable_prefix_caching=False, speculative="ngram")


PROMPTS = [
    "def main(",
    "import os\nimport sys",
    "class Foo:\n    def",
    "x = 1",
    "for i in range(10):",
    "a b c",
]


@pytest.mark.parametrize("reserve", ["max_model_len", "prompt_plus_max_tokens"])
def test_greedy_tokens_are_the_paged_engines_exactly(
    tiny_llama_dir: Path, reserve: ContiguousReserve
) -> None:
    """The memory layout must not change results: the same greedy tokens with either allocator, though
    the contiguous pool (24 blocks of 8, three 64-token reservations) holds fewer requests at once."""

    def run(**allocator: Any) -> tuple[list[list[int]], int]:
        config = EngineConfig(
            max_num_seqs=8,
            num_kv_blocks=24,
            block_size=8,
            max_model_len=64,
            enable_prefix_caching=False,
            dtype="float32",
            device="cpu",
            **allocator,
        )
        engine = LLMEngine(tiny_llama_dir, config)
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(str(index), prompt, params)
        done: dict[str, list[int]] = {}
        peak = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = list(output.outputs[0].token_ids)
            peak = max(peak, engine.stats().num_running)
            engine.kv_cache.check_consistency()
        assert engine.stats().num_used_blocks == 0
        return [done[str(index)] for index in range(len(PROMPTS))], peak

    paged, paged_peak = run()
    contiguous, contiguous_peak = run(kv_allocator="contiguous", contiguous_reserve=reserve)
    assert contiguous == paged
    assert all(len(tokens) == 20 for tokens in paged)
    if reserve == "max_model_len":
        assert contiguous_peak == 3 < paged_peak


def test_the_engine_refuses_n_above_one_with_contiguous_memory(tiny_llama_dir: Path) -> None:
    config = EngineConfig(
        num_kv_blocks=16,
        kv_allocator="contiguous",
        enable_prefix_caching=False,
        dtype="float32",
        device="cpu",
    )
    engine = LLMEngine(tiny_llama_dir, config)
    with pytest.raises(ValueError, match="n=2"):
        engine.add_request("n2", "x = 1", SamplingParams(max_tokens=4, n=2))
