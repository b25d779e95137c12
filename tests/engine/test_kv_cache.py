"""Block pool: allocation, ref counts, prefix caching, copy-on-write, LRU reuse, random-op invariants."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.engine.kv_cache import KVCacheManager


def test_allocate_covers_tokens_and_fails_cleanly_when_short() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.match_prefix("a", [1] * 10)
    assert kv.allocate("a", 0, 10)
    assert len(kv.block_table("a")) == 3
    assert kv.num_free_blocks == 1
    kv.match_prefix("b", [2] * 9)
    assert not kv.allocate("b", 0, 9)  # needs 3, only 1 free: nothing changes
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4
    kv.check_consistency()


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    assert kv.match_prefix("a", prompt) == 0
    assert kv.allocate("a", 0, 12)
    kv.cache_full_blocks("a", prompt, 12)
    # Same 12 tokens: only 2 blocks match (one token must remain to compute logits).
    assert kv.match_prefix("b", prompt) == 8
    assert kv.block_table("b") == kv.block_table("a")[:2]
    assert kv.ref_counts[kv.block_table("a")[0]] == 2
    # A prompt that diverges in its second block matches one block only.
    other = [*range(4), 99, *range(5, 12)]
    assert kv.match_prefix("c", other) == 4
    assert kv.stats().prefix_cache_hits == 12
    kv.check_consistency()


def test_an_empty_prefix_query_counts_no_queried_tokens() -> None:
    """The scheduler queries with no tokens for a request that wants prompt logprobs (it skips the
    cache): the queried-token counter, a Prometheus counter, must not go down."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.match_prefix("a", []) == 0
    assert kv.stats().prefix_cache_queries == 0
    assert kv.match_prefix("b", list(range(9))) == 0
    assert kv.stats().prefix_cache_queries == 8


def test_freed_cached_blocks_stay_reusable_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    prompt = [5, 6, 7, 8, 9]
    kv.match_prefix("a", prompt)
    kv.allocate("a", 0, 5)
    kv.cache_full_blocks("a", prompt, 5)
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.match_prefix("b", prompt) == 4  # still cached after free
    kv.free("b")
    # Filling the whole pool with something else evicts them.
    kv.match_prefix("c", [1] * 8)
    kv.allocate("c", 0, 8)
    kv.free("c")
    assert kv.match_prefix("d", prompt) == 0
    assert kv.stats().num_evictions == 2


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    cached = [1, 2, 3, 4, 5]
    kv.match_prefix("a", cached)
    kv.allocate("a", 0, 5)
    kv.cache_full_blocks("a", cached, 5)
    kv.free("a")  # two cached blocks, one uncached (the partial tail)
    kv.match_prefix("b", [9, 9])
    kv.allocate("b", 0, 2)
    kv.match_prefix("c", [8, 8])
    kv.allocate("c", 0, 2)
    # The two new sequences took the never-used block and the uncached tail: the cache survives.
    assert kv.match_prefix("d", cached) == 4


def test_fork_shares_blocks_and_copies_partial_block_on_write() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.match_prefix("p", [1] * 6)
    kv.allocate("p", 0, 6)
    kv.fork("p", "c")
    assert kv.block_table("c") == kv.block_table("p")
    shared_tail = kv.block_table("p")[1]
    assert kv.ref_counts[shared_tail] == 2
    # The child writes token 6 into the half-full shared block: it gets its own copy.
    assert kv.allocate("c", 6, 1)
    assert kv.pending_copies == [(shared_tail, kv.block_table("c")[1])]
    assert kv.block_table("c")[0] == kv.block_table("p")[0]
    assert kv.ref_counts[shared_tail] == 1
    # The parent now owns its tail alone: no copy.
    kv.pending_copies.clear()
    assert kv.allocate("p", 6, 1)
    assert kv.pending_copies == []
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 6
    kv.check_consistency()


def test_block_keys_are_a_sha256_chain_over_the_parent_digest_and_the_token_ids() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(1000, 1013))
    kv.match_prefix("a", prompt)
    kv.allocate("a", 0, len(prompt))
    kv.cache_full_blocks("a", prompt, len(prompt))
    # The spec, computed independently: the chain starts at a digest of the extra keys (no salt here).
    parent = hashlib.sha256(
        b"inflight-prefix-cache-v1\0" + json.dumps({"cache_salt": None}).encode()
    ).digest()
    for i, block in enumerate(kv.block_table("a")[:3]):
        tokens = prompt[i * 4 : (i + 1) * 4]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in tokens)).digest()
        assert kv.cached_block(parent) == block


def test_a_cache_salt_separates_prefixes() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    kv.match_prefix("a", prompt, cache_salt="tenant-a")
    kv.allocate("a", 0, len(prompt))
    kv.cache_full_blocks("a", prompt, len(prompt))
    assert kv.match_prefix("b", prompt, cache_salt="tenant-b") == 0  # another tenant: no shared blocks
    assert kv.match_prefix("c", prompt) == 0  # no salt is a salt of its own
    assert kv.match_prefix("d", prompt, cache_salt="tenant-a") == 8  # the same tenant hits
    kv.allocate("b", 0, len(prompt))
    kv.cache_full_blocks("b", prompt, len(prompt))
    assert set(kv.block_table("b")).isdisjoint(kv.block_table("a"))
    kv.check_consistency()


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=16)


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "grow", "fork", "free"]),
        st.integers(0, 7),  # which sequence
        st.integers(1, 9),  # how many tokens
        st.integers(0, 2),  # which prompt family (shared prefixes)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_random_operations_keep_the_pool_consistent(
    ops: list[tuple[str, int, int, int]], caching: bool
) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=3, enable_prefix_caching=caching)
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    cached: set[tuple[str | None, int]] = set()  # (salt, prompt family) whose first block was cached
    for op, which, count, family in ops:
        seq = f"s{which}"
        if op == "new" and seq not in tokens:
            prompt = [family] * 4 + list(range(count))
            salt = None if which % 3 == 0 else f"tenant-{which % 3}"
            hit = kv.match_prefix(seq, prompt, cache_salt=salt)
            assert hit % 3 == 0 and hit < len(prompt)
            assert hit == 0 or (salt, family) in cached  # only blocks cached under the same salt match
            tokens[seq], computed[seq] = prompt, hit
            if kv.allocate(seq, hit, len(prompt) - hit):
                computed[seq] = len(prompt)
                kv.cache_full_blocks(seq, prompt, len(prompt))
                cached.add((salt, family))
        elif op == "grow" and seq in tokens:
            before = kv.block_table(seq)[:]
            start = computed[seq]
            new = list(range(100, 100 + count))
            if kv.allocate(seq, start, len(tokens[seq]) + count - start):
                tokens[seq] += new
                computed[seq] = len(tokens[seq])
                kv.cache_full_blocks(seq, tokens[seq], computed[seq])
                assert len(kv.block_table(seq)) == kv.blocks_for(computed[seq])
            else:
                assert kv.block_table(seq) == before
        elif op == "fork" and seq in tokens:
            child = f"s{(which + count) % 8}"
            if child not in tokens:
                kv.fork(seq, child)
                tokens[child], computed[child] = list(tokens[seq]), computed[seq]
        elif op == "free" and seq in tokens:
            kv.free(seq)
            del tokens[seq], computed[seq]
        kv.check_consistency()
        for copy_src, copy_dst in kv.pending_copies:
            assert copy_src != copy_dst
        kv.pending_copies.clear()
    for seq in list(tokens):
        kv.free(seq)
    kv.check_consistency()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(rc == 0 for rc in kv.ref_counts)
