"""Paged attention on CPU: the C kernels in engine/cpu/kernels.c, reading K/V blocks where they lie.

The torch path (torch_paged.py) gathers every sequence's blocks into a contiguous buffer and then runs SDPA
over it: on CPU that is two trips through memory for every key and value, and the gather alone was a third
of decode attention's time. Here decode rows go through `paged_decode` (one work item per row, or per
(row, KV head) when there are few rows: scores, exact softmax and weighted sum straight from the blocks),
the rows of prompts through `paged_prefill` (one work item per 32 rows of a prompt and KV head: the keys
those rows attend converted, 256 at a time, into tiles that every query head of the group shares, with an
online softmax across the blocks of keys; faster than SDPA at every prompt length measured, 256 to 2048
tokens and chunks after a 3,584-token prefix, on CPUs without AMX). Where the CPU has AMX-BF16 (Intel
Sapphire Rapids+), bfloat16 prompt chunks whose rows times keys reach PROMPT_PAIRS_FOR_FLASH go through
torch's CPU flash attention instead, which multiplies on the AMX tiles (`prefill_by_flash_attention`: 1.8x
the kernel at 512 rows, 3.8-4.1x from 2048, 2.1x for 64 rows after 4032 keys; docs/benchmarks.md). New keys
and values are stored with one C call per layer (a row copy per token) instead of two index_copy_
dispatches. Where the kernels are unavailable (see cpu/kernels.py) or cannot take the inputs, this is the
torch path.
"""

from __future__ import annotations

import ctypes

import torch

from inflight.engine.attention import torch_paged
from inflight.engine.attention.kv_store import to_cache
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.isa import cpu_isa

# A bfloat16 prompt chunk is attended by flash attention where the CPU has AMX-BF16 when its rows times the
# keys it attends reach this. A lone call is faster from 128 x 128 (the kernel 0.17 ms, flash attention
# 0.14), but a step's prompts of 16-256 rows ran ~3 % slower through it than through the kernel's one call
# (gathers, Python per prompt); 512 x 512 saves 0.8 ms a call (1.84 against 1.04), 64 rows after 4032 keys
# 1.8 ms (3.38 against 1.62). docs/benchmarks.md.
PROMPT_PAIRS_FOR_FLASH = 512 * 512


def kernel_available() -> bool:
    """True when the C kernels are built and loaded (builds them on first call)."""
    return cpu_kernels.library() is not None


def _library_for(rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels, when they can take query/key rows of this dtype with these caches: the same dtype, or
    float8 caches (`--kv-cache-dtype fp8`)."""
    if k_cache.dtype != rows.dtype and k_cache.dtype in cpu_kernels.KV_DTYPE_CODES:
        library = cpu_kernels.library_for(rows)
        return library if v_cache.dtype == k_cache.dtype and k_cache.is_cpu and v_cache.is_cpu else None
    return cpu_kernels.library_for(rows, k_cache, v_cache)


def _kernel_handles(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The layouts the kernel reads: query heads contiguous within a token's row (rows may be apart, as in
    a view into the fused q|k|v projection), whole caches."""
    return _rows_dense(query) and k_cache.is_contiguous() and v_cache.is_contiguous()


def _rows_dense(rows: torch.Tensor) -> bool:
    """[T, num_kv_heads, head_dim] whose heads are contiguous within a row (rows may be apart)."""
    return rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as torch_paged.write_kv_cache. The kernel trusts the slots (the engine's own, from its
    block tables); the torch path, which checks them, is the reference. Rows for a float8 cache are
    converted first (kv_store.to_cache), then copied like any other."""
    library = _library_for(key, k_cache, v_cache) if key.dtype == value.dtype else None
    if library is not None and k_cache.dtype != key.dtype:
        key, value = to_cache(key, k_cache.dtype), to_cache(value, v_cache.dtype)
    usable = (
        library is not None
        and _rows_dense(key)
        and _rows_dense(value)
        and key.stride(0) == value.stride(0)
        and key.shape[1:] == value.shape[1:] == k_cache.shape[2:]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.shape[0] == key.shape[0]
    )
    if library is None or not usable:
        torch_paged.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    elem_size = key.element_size()
    library.write_kv(
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0) * elem_size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2] * elem_size,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as torch_paged.paged_attention: decode rows through the decode kernel, the rows of
    prompts through the prefill kernel."""
    library = _library_for(query, k_cache, v_cache)
    if library is None or not _kernel_handles(query, k_cache, v_cache):
        return torch_paged.paged_attention(query, k_cache, v_cache, meta, scale)
    out = query.new_empty(query.shape)
    block_tables = meta.block_tables.to(torch.int32).contiguous()
    # Both kernels take (q, its row stride, the caches, the block tables, their stride, <their rows>, the
    # attention shape, scale, dtype, out, the longest context, threads).
    tensors = (
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
    )
    shape = (query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1], meta.sliding_window or 0)
    dtypes = (cpu_kernels.DTYPE_CODES[query.dtype], cpu_kernels.KV_DTYPE_CODES[k_cache.dtype])
    rest = (*shape, scale, *dtypes, out.data_ptr(), meta.max_seq_len, torch.get_num_threads())
    failed = 0
    rows, seqs, lens = meta.decode_rows
    if rows.numel():
        rows_args = (lens.data_ptr(), rows.data_ptr(), seqs.data_ptr(), rows.numel())
        failed |= library.paged_decode(*tensors, *rows_args, *rest)
    prompts = meta.prompts
    # Decode-only steps (most steps) have no prompts: no per-layer tensor work to split them.
    if prompts.shape[0] and _flash_attention_multiplies_faster(query, k_cache):
        long = prompts[:, 2] * prompts[:, 3] >= PROMPT_PAIRS_FOR_FLASH
        for index, first_row, query_len, seq_len in prompts[long].tolist():
            chunk = slice(first_row, first_row + query_len)
            table = meta.block_tables[index]
            if meta.sliding_window is None:
                out[chunk] = prefill_by_flash_attention(query[chunk], k_cache, v_cache, table, seq_len, scale)
            else:
                out[chunk] = torch_paged.prefill(
                    query[chunk], k_cache, v_cache, table, seq_len, meta.sliding_window, scale
                )
        prompts = prompts[~long].contiguous()
    if prompts.shape[0]:
        failed |= library.paged_prefill(*tensors, prompts.data_ptr(), prompts.shape[0], *rest)
    if failed:
        raise MemoryError("CPU paged attention: could not allocate the kernel's scratch memory")
    return out


def _flash_attention_multiplies_faster(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether long prompt chunks go through flash attention: bfloat16 rows and cache, a CPU with AMX-BF16."""
    return query.dtype == k_cache.dtype == torch.bfloat16 and cpu_isa().amx_bf16


def prefill_by_flash_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """The last Q tokens of one sequence ([Q, Hq, D] -> [Q, Hq, D]) by torch's CPU flash attention, without a
    mask: the keys before the chunk, which every row sees whole (the query heads of a KV head's group stacked
    as rows of that head), and the chunk's own keys, causal, are two calls whose softmaxes are merged by their
    log-sum-exps. A mask would have it compute every masked block too (a 2048-row chunk after 2048 keys: 29.9
    against 20.1 ms)."""
    query_len, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group, prefix = num_heads // num_kv_heads, seq_len - query_len
    keys, values = torch_paged.gather_context(k_cache, v_cache, block_table, seq_len, query.dtype)
    q = query.transpose(0, 1)[None]  # [1, Hq, Q, D]
    own, own_lse = _flash(q, keys[None, :, prefix:], values[None, :, prefix:], scale, causal=True)
    if prefix == 0:
        return own[0].transpose(0, 1)
    stacked = q.reshape(1, num_kv_heads, group * query_len, head_dim)
    seen, seen_lse = _flash(stacked, keys[None, :, :prefix], values[None, :, :prefix], scale, causal=False)
    seen, seen_lse = seen.reshape(own.shape), seen_lse.reshape(own_lse.shape)
    peak = torch.maximum(own_lse, seen_lse)
    own_weight, seen_weight = (own_lse - peak).exp_(), (seen_lse - peak).exp_()
    merged = (own.float() * own_weight[..., None]).add_(seen.float() * seen_weight[..., None])
    merged /= (own_weight + seen_weight)[..., None]
    return merged.to(query.dtype)[0].transpose(0, 1)


def _flash(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: ([1, Hq, Q, D] output, [1, Hq, Q] float32 log-sum-exp of the scaled
    scores); keys and values [1, Hkv, L, D] with Hq a multiple of Hkv."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, causal, scale=scale
    )
    return out, lse
