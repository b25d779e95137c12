"""Paged attention in plain PyTorch: the reference path, and the one that runs on CPU.

K/V are read through each sequence's block table (see metadata.py for the layout). Decode-only
batches gather every sequence's keys at once and run one batched SDPA with a padding mask;
sequences with more than one new token (prefill, chunked prefill after a cached prefix) run one
SDPA each with a causal mask offset by the cached length.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from inflight.engine.attention.kv_store import to_cache
from inflight.engine.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new tokens' key/value rows ([T, num_kv_heads, head_dim]) at their slots (as cache
    elements: kv_store.to_cache)."""
    for rows, cache in ((key, k_cache), (value, v_cache)):
        elements = to_cache(rows, cache.dtype)
        if cache.element_size() == 1:  # index_copy_ has no float8 kernel: copy the bytes
            cache, elements = cache.view(torch.uint8), elements.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, elements)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the step's new tokens ([T, num_heads, head_dim]) over their cached contexts."""
    if meta.is_decode_only:
        everyone = list(range(meta.num_seqs))
        return _decode_grouped(query, k_cache, v_cache, meta, everyone, everyone, scale)
    out = torch.empty_like(query)
    decode_seqs, decode_rows = _attend_prefills(out, query, k_cache, v_cache, meta, scale)
    if decode_seqs:
        rows = torch.tensor(decode_rows, device=query.device)
        out[rows] = _decode_grouped(query, k_cache, v_cache, meta, decode_seqs, decode_rows, scale)
    return out


def _attend_prefills(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> tuple[list[int], list[int]]:
    """Write into `out` the attention of every sequence with more than one new token (one SDPA each);
    return the decode sequences (one new token) and their query rows, for the caller to attend."""
    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    start = 0
    for i, query_len in enumerate(meta.query_lens_list):
        if query_len == 1:
            decode_seqs.append(i)
            decode_rows.append(start)
        else:
            rows = slice(start, start + query_len)
            out[rows] = prefill(
                query[rows],
                k_cache,
                v_cache,
                meta.block_tables[i],
                meta.seq_lens_list[i],
                meta.sliding_window,
                scale,
            )
        start += query_len
    return decode_seqs, decode_rows


# Decode sequences are attended in groups of this many with similar context lengths, so each group's
# gather pads to its own longest context instead of the batch's (contexts of 16..512 tokens: about half
# the K/V gathered and attended). Same results: padding is masked either way.
DECODE_GROUP_SIZE = 16


def _decode_grouped(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],
    rows: list[int],
    scale: float,
) -> torch.Tensor:
    """Decode query rows `rows` (one each of sequences `seqs`) -> [len(rows), Hq, D]."""
    device = query.device
    out = query.new_empty((len(rows), *query.shape[1:]))
    order = sorted(range(len(seqs)), key=lambda j: meta.seq_lens_list[seqs[j]])
    for first in range(0, len(order), DECODE_GROUP_SIZE):
        group = order[first : first + DECODE_GROUP_SIZE]
        group_seqs = torch.tensor([seqs[j] for j in group], device=device)
        out[torch.tensor(group, device=device)] = _decode(
            query[torch.tensor([rows[j] for j in group], device=device)],
            k_cache,
            v_cache,
            meta.block_tables[group_seqs],
            meta.seq_lens[group_seqs],
            meta.seq_lens_list[seqs[group[-1]]],
            meta.sliding_window,
            scale,
        )
    return out


class _Workspace(threading.local):
    """Reused gather buffers, one per (name, dtype, device, inference mode) and thread.

    A fresh multi-megabyte tensor per layer and step costs more than the copy into it on CPU
    (the allocator hands large blocks back to the OS, so every step page-faults them in again).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # A buffer made under inference mode cannot be written outside it: one set for each mode.
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buffer
        return buffer[:numel]


_WORKSPACE = _Workspace()


def _gather(
    cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int, name: str, dtype: torch.dtype
) -> torch.Tensor:
    """[..., num_blocks * block_size, num_kv_heads, head_dim]: the first `num_blocks` blocks of a table,
    as `dtype` (the query's: a float8 cache is widened).

    The result lives in the `name` workspace buffer: valid until the next gather with that name.
    """
    ids = block_table[..., :num_blocks]
    rows = cache.view(cache.shape[0], -1)
    out = _WORKSPACE.get(name, ids.numel() * rows.shape[1], cache.dtype, cache.device)
    torch.index_select(rows, 0, ids.reshape(-1), out=out.view(ids.numel(), rows.shape[1]))
    gathered = out.view(*ids.shape[:-1], num_blocks * cache.shape[1], *cache.shape[2:])
    return gathered if cache.dtype == dtype else gathered.to(dtype)


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sliding_window: int | None,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence: query [B, Hq, D] -> [B, Hq, D]."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    keys = _gather(k_cache, block_tables, num_blocks, "k", query.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    values = _gather(v_cache, block_tables, num_blocks, "v", query.dtype).transpose(1, 2)
    key_pos = torch.arange(keys.shape[2], device=query.device)
    lens = seq_lens.to(torch.int64)[:, None]
    mask = key_pos[None, :] < lens
    if sliding_window is not None:
        mask &= key_pos[None, :] >= lens - sliding_window
    # Query heads sharing a KV head become that head's "query rows": no K/V repeat needed.
    grouped = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` keys and values, [Hkv, L, D] each, as `dtype` (in the workspace
    buffers: valid until the next gather)."""
    num_blocks = -(-seq_len // k_cache.shape[1])
    keys = _gather(k_cache, block_table, num_blocks, "k", dtype)[:seq_len].transpose(0, 1)
    values = _gather(v_cache, block_table, num_blocks, "v", dtype)[:seq_len].transpose(0, 1)
    return keys, values


def prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    sliding_window: int | None,
    scale: float,
) -> torch.Tensor:
    """The last `query_len` tokens of one sequence: query [Q, Hq, D] -> [Q, Hq, D]."""
    query_len = query.shape[0]
    keys, values = gather_context(k_cache, v_cache, block_table, seq_len, query.dtype)
    # A leading batch dimension: without it SDPA takes its slow math path on CPU instead of flash attention.
    q, keys, values = query.transpose(0, 1)[None], keys[None], values[None]  # [1, H, L, D]
    if query_len == seq_len and sliding_window is None:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at position seq_len - query_len + j and sees keys up to that position.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
