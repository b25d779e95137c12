"""Paged attention on CUDA through Triton kernels; the same functions as `torch_paged`.

This module imports without triton (the engine runs on CPU without it): the kernels are loaded on
first use, and `triton_available()` says whether they can be. With `TRITON_INTERPRET=1` the kernels
also run on CPU tensors (slowly), which is how the tests check them against the torch reference.
"""

from __future__ import annotations

import importlib.util
import math
from functools import cache
from types import ModuleType

import torch

from inflight.engine.attention.kv_store import FP8_DTYPE, FP8_MAX
from inflight.engine.attention.metadata import AttentionMetadata

# Key tokens per inner-loop tile, and the query tokens per program in prefill.
BLOCK_N = 64
PREFILL_ROWS = 64
# Split-K only pays when the context is long enough for each split to read a few tiles.
MIN_SPLIT_LEN = 256
MAX_SPLITS = 64


@cache
def triton_available() -> bool:
    """True where the triton package is installed (asked once: a module search costs microseconds, and the
    FP8 products ask on every call)."""
    return importlib.util.find_spec("triton") is not None


@cache
def _kernels() -> ModuleType:
    if not triton_available():
        raise RuntimeError(
            "The Triton attention backend needs the `triton` package; install it (`pip install triton`) "
            "or use the torch backend."
        )
    from inflight.engine.attention import triton_kernels

    return triton_kernels


def triton_interpreting() -> bool:
    """True where Triton runs its kernels in its interpreter (TRITON_INTERPRET=1: tests on CPU)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, num_kv_heads, head_dim] into the caches at `slot_mapping` (slots < 0 skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("write_kv_cache needs the last (head_dim) dimension of key, value and cache dense")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same layout")
    _kernels().write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=_pow2(num_kv_heads),
        DIM_PAD=max(_pow2(head_dim), 16),
        FP8_MAX=FP8_MAX if k_cache.dtype == FP8_DTYPE else 0.0,
    )


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split the key range when too few programs would fill the GPU and the contexts are long."""
    target = 2 * _multiprocessor_count(device)
    if num_programs >= target or max_seq_len < 2 * MIN_SPLIT_LEN:
        return 1
    by_length = max_seq_len // MIN_SPLIT_LEN
    by_occupancy = math.ceil(target / num_programs)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, num_heads, head_dim] over each sequence's paged context.

    Returns [T, num_heads, head_dim] in the query's dtype. `num_splits` forces the split-K factor
    (default: chosen from the batch shape; split-K is used for decode-only batches).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("paged_attention needs the last (head_dim) dimension of query and cache dense")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same layout")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    if meta.is_decode_only:
        block_m = 1
        group_pad = max(group_pad, 16)  # tl.dot needs at least 16 rows
    else:
        block_m = max(PREFILL_ROWS // group_pad, 1)
        group_pad = max(group_pad, 16 // block_m)
    num_q_tiles = math.ceil(meta.max_query_len / block_m)
    grid_programs = meta.num_seqs * num_q_tiles * num_kv_heads
    if num_splits is None:
        num_splits = (
            choose_num_splits(grid_programs, meta.max_seq_len, query.device) if meta.is_decode_only else 1
        )
    split_len = math.ceil(math.ceil(meta.max_seq_len / num_splits) / BLOCK_N) * BLOCK_N
    num_splits = max(1, math.ceil(meta.max_seq_len / split_len))
    dim_pad = max(_pow2(head_dim), 16)

    if num_splits > 1:
        partial_out = torch.empty(
            num_tokens, num_heads, num_splits, dim_pad, dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused by the kernel when NUM_SPLITS == 1

    kernels = _kernels()
    kernels.paged_attention_kernel[(meta.num_seqs * num_q_tiles, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        partial_out,
        partial_max,
        partial_sum,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * kernels.LOG2E,
        num_q_tiles,
        split_len,
        meta.sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        num_heads,
        head_dim,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        USE_WINDOW=meta.sliding_window is not None,
        DOT_IN_FP32=query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and triton_interpreting()),
        KV_FP8=k_cache.dtype == FP8_DTYPE,
    )
    if num_splits > 1:
        kernels.reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=_pow2(num_splits),
            DIM_PAD=dim_pad,
        )
    return out
