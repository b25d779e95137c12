"""Paged attention on CPU: decode rows through the C kernel in engine/cpu/kernels.c.

The torch path (torch_paged.py) gathers every decode sequence's blocks into a contiguous buffer and then
runs SDPA over it: on CPU that is two trips through memory for every key and value, and the gather alone
was a third of attention's time. The kernel scores, softmaxes and sums straight from the blocks, one work
item per query row (or per (row, KV head) when there are few rows) over torch's threads. A prompt's rows
go through it too, each row a causal "decode" over the keys before it (the prompt's K/V, just written,
is in cache): at prompt lengths up to KERNEL_PREFILL_MAX_LEN that is faster than gathering the blocks
and calling SDPA per prompt; longer prompts keep SDPA, whose tiles amortize better as a prompt grows.
New keys and values are stored with one C call per layer (a row copy per token) instead of two
index_copy_ dispatches. Where the kernels are unavailable (see cpu/kernels.py) or cannot take the
inputs, this is the torch path.
"""

from __future__ import annotations

import torch

from inflight.engine.attention import torch_paged
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels

# Prompts (prefill and chunked-prefill sequences) with at most this many keys are attended by the kernel
# row by row; longer ones by SDPA. Measured at SmolLM2's attention shape in bfloat16 (docs/benchmarks.md):
# the kernel ahead at 150 keys, SDPA at 512.
KERNEL_PREFILL_MAX_LEN = 256


def kernel_available() -> bool:
    """True when the C kernels are built and loaded (builds them on first call)."""
    return cpu_kernels.library() is not None


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
    block tables); the torch path, which checks them, is the reference."""
    library = cpu_kernels.library_for(key, value, k_cache, v_cache)
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
    """Same contract as torch_paged.paged_attention; decode rows, and the rows of prompts with at most
    KERNEL_PREFILL_MAX_LEN keys, go through the C kernel."""
    library = cpu_kernels.library_for(query, k_cache, v_cache)
    if library is None or not _kernel_handles(query, k_cache, v_cache):
        return torch_paged.paged_attention(query, k_cache, v_cache, meta, scale)
    out = query.new_empty(query.shape)
    # Every layer of the step attends the same rows: their index tensors are made once per step.
    rows_tensor, seqs_tensor, lens = meta.query_rows
    max_len = meta.max_seq_len
    if not meta.is_decode_only:
        lengths = zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
        long_prompts = [
            i
            for i, (query_len, seq_len) in enumerate(lengths)
            if query_len > 1 and seq_len > KERNEL_PREFILL_MAX_LEN
        ]
        if long_prompts:
            rows_tensor, seqs_tensor, lens, max_len = _attend_long_prompts(
                out, query, k_cache, v_cache, meta, scale, long_prompts
            )
            if rows_tensor.numel() == 0:
                return out
    block_tables = meta.block_tables.to(torch.int32).contiguous()
    failed = library.paged_decode(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        lens.data_ptr(),
        rows_tensor.data_ptr(),
        seqs_tensor.data_ptr(),
        rows_tensor.numel(),
        query.shape[1],
        k_cache.shape[2],
        query.shape[2],
        k_cache.shape[1],
        meta.sliding_window or 0,
        scale,
        cpu_kernels.DTYPE_CODES[query.dtype],
        out.data_ptr(),
        max_len,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("CPU paged attention: could not allocate the kernel's scratch memory")
    return out


def _attend_long_prompts(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    long_prompts: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """SDPA for the rows of `long_prompts` (written into `out`); the other rows for the kernel:
    (rows, their sequences, their key counts, the largest count)."""
    starts = meta.query_start_loc.tolist()
    all_rows, sequences, lens = meta.query_rows
    keep = torch.ones(query.shape[0], dtype=torch.bool)
    for i in long_prompts:
        torch_paged.attend_prompt(
            out, query, k_cache, v_cache, meta, scale, i, slice(starts[i], starts[i + 1])
        )
        keep[starts[i] : starts[i + 1]] = False
    rows = all_rows[keep]
    kept_lens = lens[rows].contiguous()
    return rows, sequences[rows].contiguous(), kept_lens, int(kept_lens.max()) if rows.numel() else 0
