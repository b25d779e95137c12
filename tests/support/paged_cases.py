"""Random paged KV caches and batches, and a dense float64 attention reference to check kernels against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.engine.attention.metadata import AttentionMetadata


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    seed: int = 0,
) -> PagedCase:
    """Sequences with the given context lengths whose last `query_lens` tokens are new this step.

    Blocks are handed out in a shuffled order, so contiguous-looking reads would be wrong.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    next_block = 0
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = order[next_block : next_block + blocks_per_seq[i]]
        next_block += blocks_per_seq[i]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    query = randn(sum(query_lens), num_heads, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        sliding_window=sliding_window,
    )
    return PagedCase(query, k_cache, v_cache, meta, head_dim**-0.5)


def dense_reference(case: PagedCase) -> torch.Tensor:
    """Attention computed in float64 from each sequence's keys gathered token by token."""
    meta = case.meta
    num_heads = case.query.shape[1]
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(case.query.shape, dtype=torch.float64)
    start = 0
    for i, (seq_len, query_len) in enumerate(zip(meta.seq_lens_list, meta.query_lens_list, strict=True)):
        positions = torch.arange(seq_len)
        blocks = meta.block_tables[i, positions // block_size].long()
        keys = case.k_cache[blocks, positions % block_size].double()  # [seq_len, kv_heads, dim]
        values = case.v_cache[blocks, positions % block_size].double()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        q = case.query[start : start + query_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * case.scale
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        visible = positions[None, :] <= q_pos
        if meta.sliding_window is not None:
            visible &= positions[None, :] > q_pos - meta.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        start += query_len
    return out
