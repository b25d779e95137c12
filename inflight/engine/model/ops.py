"""The decoder's elementwise steps: each a PyTorch reference and, on CPU, one fused C kernel call.

On CPU (float32, bfloat16) with the kernels built (engine/cpu/kernels.py) every function below is a single
pass over its data; elsewhere (CUDA, float16, no compiler) it is the PyTorch code, which is also the
definition of what the kernel computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inflight.engine.cpu import kernels as cpu_kernels


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h) * weight, h) for h = x + residual, or h = x without a residual.

    With a residual the sum is written into `residual` in place where the kernel runs: the caller hands
    over the tensor and uses the returned one."""
    library = (
        cpu_kernels.library_for(x, weight)
        if residual is None
        else cpu_kernels.library_for(x, weight, residual)
    )
    if library is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        out = torch.empty_like(x)
        rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
        library.rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            cpu_kernels.DTYPE_CODES[x.dtype],
            torch.get_num_threads(),
        )
        return out, x if residual is None else residual
    summed = x if residual is None else residual + x
    dtype = summed.dtype
    h = summed.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    width = gate_up.shape[-1] // 2
    library = cpu_kernels.library_for(gate_up)
    if library is not None and gate_up.is_contiguous():
        out = gate_up.new_empty((*gate_up.shape[:-1], width))
        library.silu_and_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            gate_up.numel() // gate_up.shape[-1],
            width,
            cpu_kernels.DTYPE_CODES[gate_up.dtype],
            torch.get_num_threads(),
        )
        return out
    gate, up = gate_up.split(width, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_tables(
    cos: torch.Tensor, sin: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's float32 cos/sin in the dtype `split_qkv_with_rotary` wants for activations like `like`:
    float32 for the kernel, else the activations' dtype. Once per step, not once per layer."""
    if cpu_kernels.library_for(like) is not None:
        return cos, sin
    return cos.to(like.dtype), sin.to(like.dtype)


def split_qkv_with_rotary(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, Hkv, D] from the fused projection [T, (H + 2 Hkv) D], q and k rotated.

    cos and sin are [T, 1, D / 2] from `rotary_tables` (float32 where the kernel runs). The kernel
    rotates q and k in place inside `qkv` and returns views of it; the PyTorch code returns new tensors
    for q and k."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    library = cpu_kernels.library_for(qkv)
    tables_usable = cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    if library is not None and qkv.is_contiguous() and tables_usable:
        library.rotary(
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            num_tokens,
            num_heads + num_kv_heads,
            head_dim,
            cpu_kernels.DTYPE_CODES[qkv.dtype],
            torch.get_num_threads(),
        )
        rotated = True
    else:
        rotated = False
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if not rotated:
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
    return q, k, v
