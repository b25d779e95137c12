"""The two collectives the sharded model calls inside its forward pass (default process group)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over all ranks, in place; every rank gets the total."""
    dist.all_reduce(x)
    return x


def gather_vocab(local: torch.Tensor, vocab_size: int, world_size: int) -> torch.Tensor:
    """Concatenate every rank's [rows, V/N] logits slice along the vocabulary; cut the padding."""
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[..., :vocab_size]
