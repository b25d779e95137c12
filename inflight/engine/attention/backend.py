"""Which paged-attention implementation a device uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.engine.attention import cpu_paged, torch_paged, triton_paged
from inflight.engine.attention.metadata import AttentionMetadata

WriteKVCache = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
PagedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    """The two operations the model needs from a paged-attention implementation."""

    name: str
    write_kv_cache: WriteKVCache
    paged_attention: PagedAttention


TORCH_BACKEND = AttentionBackend(
    name="torch",
    write_kv_cache=torch_paged.write_kv_cache,
    paged_attention=torch_paged.paged_attention,
)

CPU_KERNEL_BACKEND = AttentionBackend(
    name="cpu-kernel",
    write_kv_cache=cpu_paged.write_kv_cache,
    paged_attention=cpu_paged.paged_attention,
)

TRITON_BACKEND = AttentionBackend(
    name="triton",
    write_kv_cache=triton_paged.write_kv_cache,
    paged_attention=triton_paged.paged_attention,
)


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The attention backend for `device`: Triton kernels on CUDA where triton is installed, the C decode
    kernel on CPU where it builds (see cpu_paged.py), else PyTorch."""
    if device.type == "cuda" and triton_paged.triton_available():
        return TRITON_BACKEND
    if device.type == "cpu" and cpu_paged.kernel_available():
        return CPU_KERNEL_BACKEND
    return TORCH_BACKEND
