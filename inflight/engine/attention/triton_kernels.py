"""Triton kernels for paged attention. Imported only where triton is installed (see triton_paged.py).

Layouts follow `metadata.py`: the K/V cache of a layer is [num_blocks, block_size, num_kv_heads, head_dim],
queries and outputs are [T, num_heads, head_dim] with the new tokens of all sequences concatenated.

`paged_attention_kernel` is one kernel for decode, prefill and mixed batches. A program owns one tile of
BLOCK_M query tokens of one sequence and all GROUP query heads that share one KV head, laid out as
BLOCK_M * GROUP_PAD rows (row r = token r // GROUP_PAD, head r % GROUP_PAD), so every K/V tile it reads
from memory serves the whole GQA group. It walks the keys in tiles of BLOCK_N tokens, each token found
through the block table, with an online softmax. With NUM_SPLITS > 1 the key range is split across
programs (split-K, for long contexts with few sequences) and each split writes an unnormalised partial
result that `reduce_splits_kernel` combines.

DOT_IN_FP32 makes both matrix products exact float32 ("ieee", no TF32): the engine's float32 path must
match the torch reference, and Triton's interpreter cannot multiply bfloat16 matrices (tests run there).

A float8 e4m3 cache (`--kv-cache-dtype fp8`, KV_FP8): the write kernel stores what attention/kv_store.py
stores (saturated to +-FP8_MAX, rounded to nearest even; `_round_to_e4m3`); the attention kernel widens
each K/V tile to the query's dtype as it loads it, so the matrix products are the same as for a bfloat16
cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _round_to_e4m3(x: tl.tensor, FP8_MAX: tl.constexpr) -> tl.tensor:
    """x (float32) saturated to +-FP8_MAX and rounded to nearest even on the e4m3 grid (3 mantissa bits;
    subnormals below 2^-6 in steps of 2^-9), so the cast that follows is exact. Done here rather than
    left to the cast: the GPU's cvt.rn.satfinite gives the same, Triton's interpreter (the CPU tests) does
    not (it rounds subnormals toward zero and drops the carry into the next power of two)."""
    magnitude = tl.minimum(tl.abs(x), FP8_MAX)
    exponent = (magnitude.to(tl.int32, bitcast=True) >> 23) - 127
    step_exponent = tl.maximum(exponent, -6) - 3
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2^23 rounds a float below 2^22 to an integer, to nearest even.
    rounded = ((magnitude / step + 12582912.0) - 12582912.0) * step
    return tl.where(x < 0, -rounded, rounded)  # -0.0 for small negatives, as the cast gives


@triton.jit
def write_kv_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,
    stride_key_t: int,
    stride_key_h: int,
    stride_value_t: int,
    stride_value_h: int,
    stride_cache_block: int,
    stride_cache_offset: int,
    stride_cache_h: int,
    num_kv_heads: int,
    head_dim: int,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
) -> None:
    """FP8_MAX: the float8 cache's saturation bound (0: the cache is not float8)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, DIM_PAD)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
        cache_offset = (
            (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_offset
            + heads[:, None] * stride_cache_h
            + dims[None, :]
        )
        key = tl.load(
            key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask
        )
        value = tl.load(
            value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask
        )
        if FP8_MAX > 0:
            key = _round_to_e4m3(key.to(tl.float32), FP8_MAX)
            value = _round_to_e4m3(value.to(tl.float32), FP8_MAX)
        tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def paged_attention_kernel(
    query_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    out_ptr: tl.tensor,
    partial_out_ptr: tl.tensor,
    partial_max_ptr: tl.tensor,
    partial_sum_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    query_start_loc_ptr: tl.tensor,
    qk_scale: float,
    num_q_tiles: int,
    split_len: int,
    sliding_window: int,
    stride_q_t: int,
    stride_q_h: int,
    stride_out_t: int,
    stride_out_h: int,
    stride_cache_block: int,
    stride_cache_offset: int,
    stride_cache_h: int,
    stride_block_table: int,
    num_heads: int,
    head_dim: int,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
) -> None:
    seq = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_tile * BLOCK_M < query_len:
        context_start = seq_len - query_len  # position of this sequence's first new token

        rows = tl.arange(0, BLOCK_M * GROUP_PAD)
        row_token = q_tile * BLOCK_M + rows // GROUP_PAD
        row_head = kv_head * GROUP + rows % GROUP_PAD
        row_valid = (row_token < query_len) & (rows % GROUP_PAD < GROUP)
        row_pos = context_start + row_token
        dims = tl.arange(0, DIM_PAD)
        dim_valid = dims < head_dim

        q = tl.load(
            query_ptr
            + (q_start + row_token)[:, None] * stride_q_t
            + row_head[:, None] * stride_q_h
            + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )

        # Keys this tile needs: causal up to its last token, from the window's start when one is set.
        last_pos = context_start + tl.minimum(q_tile * BLOCK_M + BLOCK_M, query_len) - 1
        kv_lo = 0
        if USE_WINDOW:
            kv_lo = tl.maximum(context_start + q_tile * BLOCK_M - sliding_window + 1, 0)
        kv_hi = last_pos + 1
        if NUM_SPLITS > 1:
            kv_lo = tl.maximum(kv_lo, split * split_len)
            kv_hi = tl.minimum(kv_hi, split * split_len + split_len)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM_PAD], dtype=tl.float32)
        block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
        head_offset = kv_head * stride_cache_h

        for start in range(kv_lo, kv_hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_valid = keys < kv_hi
            block_ids = tl.load(block_table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
            token_offset = block_ids * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_offset
            k = tl.load(
                k_cache_ptr + head_offset + token_offset[None, :] + dims[:, None],
                mask=key_valid[None, :] & dim_valid[:, None],
                other=0.0,
            )
            if KV_FP8:
                k = k.to(query_ptr.dtype.element_ty)
            if DOT_IN_FP32:
                scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * qk_scale
            else:
                scores = tl.dot(q, k) * qk_scale
            visible = key_valid[None, :] & (keys[None, :] <= row_pos[:, None])
            if USE_WINDOW:
                visible = visible & (keys[None, :] > row_pos[:, None] - sliding_window)
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_cache_ptr + head_offset + token_offset[:, None] + dims[None, :],
                mask=key_valid[:, None] & dim_valid[None, :],
                other=0.0,
            )
            if KV_FP8:
                v = v.to(query_ptr.dtype.element_ty)
            if DOT_IN_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out_rows = (q_start + row_token).to(tl.int64)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(
                out_ptr + out_rows[:, None] * stride_out_t + row_head[:, None] * stride_out_h + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_valid[:, None] & dim_valid[None, :],
            )
        else:
            # Partial results are [T, num_heads, NUM_SPLITS] (+ [DIM_PAD] for the accumulator), fp32.
            stat_index = (out_rows * num_heads + row_head) * NUM_SPLITS + split
            tl.store(partial_max_ptr + stat_index, m_i, mask=row_valid)
            tl.store(partial_sum_ptr + stat_index, l_i, mask=row_valid)
            tl.store(
                partial_out_ptr + stat_index[:, None] * DIM_PAD + dims[None, :],
                acc,
                mask=row_valid[:, None],
            )


@triton.jit
def reduce_splits_kernel(
    out_ptr: tl.tensor,
    partial_out_ptr: tl.tensor,
    partial_max_ptr: tl.tensor,
    partial_sum_ptr: tl.tensor,
    stride_out_t: int,
    stride_out_h: int,
    num_heads: int,
    head_dim: int,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_PAD)
    stat_index = (token * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(partial_max_ptr + stat_index, mask=split_valid, other=float("-inf"))
    total_max = tl.max(m, axis=0)
    safe_max = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.exp2(m - safe_max)
    total_sum = tl.sum(tl.load(partial_sum_ptr + stat_index, mask=split_valid, other=0.0) * weight, axis=0)
    acc = tl.load(
        partial_out_ptr + stat_index[:, None] * DIM_PAD + dims[None, :], mask=split_valid[:, None], other=0.0
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total_sum == 0.0, 1.0, total_sum)
    tl.store(
        out_ptr + token * stride_out_t + head * stride_out_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )
