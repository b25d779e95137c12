"""Paged attention on CPU: the C kernels in engine/cpu/kernels.c, reading K/V blocks where they lie.

The torch path (torch_paged.py) gathers every sequence's blocks into a contiguous buffer and then runs SDPA
over it: on CPU that is two trips through memory for every key and value, and the gather alone was a third
of decode attention's time. Here decode rows go through `paged_decode` (one work item per row, or per
(row, KV head) when there are few rows: scores, exact softmax and weighted sum straight from the blocks),
the rows of prompts through `paged_prefill` (one work item per 32 rows of a prompt and KV head, 64 where a
call still has eight items per thread: the keys those rows attend converted, 128 at a time, into tiles
that every query head of the group shares, with an online softmax across the blocks of keys; faster than
SDPA at every prompt length measured, 256 to 2048 tokens and chunks after a 3,584-token prefix, on CPUs
without AMX). Where the CPU has AMX-BF16 (Intel Sapphire Rapids+), bfloat16 items of 64 rows multiply
their scores and weighted sums on the AMX tiles (1.3-1.6x torch's CPU flash attention from 64 rows after
4032 keys to 4096-row prompts, 4.8x the AVX512-BF16 items at 2048 rows; docs/benchmarks.md). New keys and
values are stored with one C call per layer (a row copy per token) instead of two index_copy_ dispatches.
Where the kernels are unavailable (see cpu/kernels.py) or cannot take the inputs, this is the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from inflight.engine.attention import torch_paged
from inflight.engine.attention.kv_store import to_cache
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels


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
    if prompts.shape[0]:
        failed |= library.paged_prefill(*tensors, prompts.data_ptr(), prompts.shape[0], *rest)
    if failed:
        raise MemoryError("CPU paged attention: could not allocate the kernel's scratch memory")
    return out
