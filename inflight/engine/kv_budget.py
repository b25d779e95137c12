"""How many KV blocks fit on one device: bytes per token and per block, the memory budget (one rank's
share) and the pool size. Torch-free (torch loads only to measure a GPU): sizing.py, which the operator
plans with, uses the same formula.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.engine.config import EngineConfig
from inflight.engine.dtypes import DTYPE_BYTES, kv_cache_dtype_name
from inflight.engine.model.config import ModelConfig

if TYPE_CHECKING:
    import torch


def kv_token_bytes(num_layers: int, kv_heads_per_gpu: int, head_dim: int, dtype: str) -> int:
    """Bytes of one token's K and V over all layers on one GPU."""
    return 2 * num_layers * kv_heads_per_gpu * head_dim * DTYPE_BYTES[dtype]


def step_activation_bytes(
    hidden: int, intermediate_per_rank: int, vocab: int, max_batched_tokens: int, max_slots: int, dtype: str
) -> int:
    """Peak transient memory of one step, kept out of the KV pool: `max_batched_tokens` rows of the
    residual stream and attention projections (~4 x hidden) and the gate/up MLP activations (2 x the
    rank's intermediate size) in `dtype`, and float32 logits for at most one row per running sequence."""
    per_token = 4 * hidden + 2 * intermediate_per_rank
    logits = min(max_slots, max_batched_tokens) * vocab * 4
    return max_batched_tokens * per_token * DTYPE_BYTES[dtype] + logits


def choose_num_kv_blocks(requested: int | None, fit: int, enough: int, measured: bool) -> int:
    """Blocks for the engine's KV pool: the request if given (cut to `fit` when `fit` was measured on the
    device), else what fits, capped at `enough` (every slot at full length)."""
    if requested is None:
        return min(fit, enough)
    return min(requested, fit) if measured else requested


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for an engine running in `dtype` (config.kv_cache_dtype: auto or fp8)."""
    import torch

    return getattr(torch, kv_cache_dtype_name(config.kv_cache_dtype, str(dtype).removeprefix("torch.")))


def kv_block_bytes(model: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers for `num_kv_heads` heads (a rank's, with tensor parallelism),
    `dtype` the cache's element type (kv_cache_dtype)."""
    name = str(dtype).removeprefix("torch.")
    return block_size * kv_token_bytes(model.num_hidden_layers, num_kv_heads, model.head_dim, name)


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> float:
    """Memory for the KV pool on `device`: free GPU memory less the unused share, or the CPU setting."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return free - total * (1 - config.gpu_memory_utilization)
    return config.kv_cache_memory_gib * 2**30
