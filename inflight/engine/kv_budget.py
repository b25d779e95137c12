"""How many KV blocks fit on one device: bytes per block and the memory budget (one rank's share)."""

from __future__ import annotations

import torch

from inflight.engine.config import EngineConfig
from inflight.engine.model.config import ModelConfig


def kv_block_bytes(model: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers for `num_kv_heads` heads (a rank's, with tensor parallelism)."""
    return 2 * model.num_hidden_layers * num_kv_heads * model.head_dim * block_size * dtype.itemsize


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> float:
    """Memory for the KV pool on `device`: free GPU memory less the unused share, or the CPU setting."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free - total * (1 - config.gpu_memory_utilization)
    return config.kv_cache_memory_gib * 2**30
