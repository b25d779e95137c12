"""Paged attention on CPU: decode rows through the C kernel in engine/cpu/kernels.c.

The torch path (torch_paged.py) gathers every decode sequence's blocks into a contiguous buffer and then
runs SDPA over it: on CPU that is two trips through memory for every key and value, and the gather alone
was a third of attention's time. The kernel scores, softmaxes and sums straight from the blocks, one work
item per sequence (or per (sequence, KV head) when there are few sequences) over torch's threads.
Prefill and chunked-prefill sequences keep the torch path (one SDPA each, where SDPA is at its best).
Where the kernels are unavailable (see cpu/kernels.py) or cannot take the inputs, this is the torch path.
"""

from __future__ import annotations

import torch

from inflight.engine.attention import torch_paged
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels


def kernel_available() -> bool:
    """True when the C kernels are built and loaded (builds them on first call)."""
    return cpu_kernels.library() is not None


def _kernel_handles(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The layouts the kernel reads: query heads contiguous within a token's row (rows may be apart, as in
    a view into the fused q|k|v projection), whole caches."""
    return (
        query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as torch_paged.paged_attention; decode rows go through the C kernel."""
    library = cpu_kernels.library_for(query, k_cache, v_cache)
    if library is None or not _kernel_handles(query, k_cache, v_cache):
        return torch_paged.paged_attention(query, k_cache, v_cache, meta, scale)
    out = query.new_empty(query.shape)
    if meta.is_decode_only:
        seqs = list(range(meta.num_seqs))
        rows = seqs
    else:
        seqs, rows = torch_paged.attend_prefills(out, query, k_cache, v_cache, meta, scale)
        if not seqs:
            return out
    block_tables = meta.block_tables.to(torch.int32).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    rows_tensor = torch.tensor(rows, dtype=torch.int64)
    seqs_tensor = rows_tensor if rows is seqs else torch.tensor(seqs, dtype=torch.int64)
    failed = library.paged_decode(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        rows_tensor.data_ptr(),
        seqs_tensor.data_ptr(),
        len(seqs),
        query.shape[1],
        k_cache.shape[2],
        query.shape[2],
        k_cache.shape[1],
        meta.sliding_window or 0,
        scale,
        cpu_kernels.DTYPE_CODES[query.dtype],
        out.data_ptr(),
        max(meta.seq_lens_list[i] for i in seqs),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("CPU paged attention: could not allocate the kernel's scratch memory")
    return out
