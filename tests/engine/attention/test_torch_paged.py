"""The torch paged-attention path against dense attention computed directly from the tokens' K/V."""

from __future__ import annotations

import math
import random

import pytest
import torch

from inflight.engine.attention.backend import get_attention_backend
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.attention.torch_paged import paged_attention, write_kv_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 64


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention of the last len(q) tokens over all len(k) tokens, one head at a time, in float64."""
    query_len, seq_len = q.shape[0], k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    group = NUM_HEADS // NUM_KV_HEADS
    for h in range(NUM_HEADS):
        scores = q[:, h].double() @ k[:, h // group].double().T / math.sqrt(HEAD_DIM)
        for j in range(query_len):
            pos = seq_len - query_len + j
            for key in range(seq_len):
                if key > pos or (window is not None and pos - key >= window):
                    scores[j, key] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group].double()
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_dense_attention(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    # (cached tokens, new tokens): fresh prefill, decode, chunk after a cached prefix, decode at a block edge.
    shapes = [(0, 9), (12, 1), (7, 6), (3, 1), (0, 1)]
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    keys, values, tables, slots, queries = [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        seq_slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)])
        write_kv_cache(k[:cached], v[:cached], k_cache, v_cache, seq_slots[:cached])  # an earlier step
        keys.append(k)
        values.append(v)
        tables.append(table)
        slots.append(seq_slots[cached:])
        queries.append(torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen))
    width = max(len(t) for t in tables)
    query_lens = [new for _, new in shapes]
    seq_lens = [cached + new for cached, new in shapes]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        sliding_window=window,
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, shapes, strict=True)])
    write_kv_cache(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta, scale=HEAD_DIM**-0.5)
    expected = torch.cat([_dense(q, k, v, window) for q, k, v in zip(queries, keys, values, strict=True)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    # Decode-only steps take the batched path; it must agree with the per-sequence one.
    decode = [i for i, q in enumerate(query_lens) if q == 1]
    rows = [int(meta.query_start_loc[i]) for i in decode]
    decode_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        query_start_loc=torch.arange(len(decode) + 1, dtype=torch.int32),
        seq_lens=meta.seq_lens[decode],
        block_tables=meta.block_tables[decode],
        query_lens_list=[1] * len(decode),
        seq_lens_list=[seq_lens[i] for i in decode],
        max_query_len=1,
        max_seq_len=max(seq_lens[i] for i in decode),
        sliding_window=window,
    )
    decoded = paged_attention(torch.cat(queries)[rows], k_cache, v_cache, decode_meta, scale=HEAD_DIM**-0.5)
    torch.testing.assert_close(decoded, out[rows], atol=1e-6, rtol=1e-6)


def test_write_kv_cache_places_rows_at_their_slots() -> None:
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv_cache(key, -key, k_cache, v_cache, torch.tensor([5, 17, 18]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(k_cache[4, 1], key[1])
    assert torch.equal(v_cache[4, 2], -key[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_cpu_uses_the_torch_backend_when_the_kernel_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from inflight.engine.attention import cpu_paged

    monkeypatch.setattr(cpu_paged, "kernel_available", lambda: False)
    backend = get_attention_backend(torch.device("cpu"))
    assert backend.name == "torch"
    assert backend.paged_attention is paged_attention
