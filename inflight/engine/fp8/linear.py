"""x W^T (+ b) for an FP8 weight W = scale * W8 (engine/fp8/weights.py), by where it runs:

- CUDA with FP8 tensor cores (compute capability 8.9 and later: Ada Lovelace, Hopper, Blackwell), bfloat16
  activations, more than WEIGHT_ONLY_MAX_ROWS rows: `torch._scaled_mm` with row-wise scales. Each token's
  activations are quantized to e4m3 on the fly (per-token dynamic scale = row amax / 448; one Triton
  kernel), so both operands are FP8 and the output is x_scale * (x8 W8^T) * w_scale, accumulated in
  float32.
- CUDA at up to WEIGHT_ONLY_MAX_ROWS rows (decode of a few sequences), without FP8 tensor cores (Ampere and
  older), or with float16 / float32 activations: a Triton kernel (triton_kernels.py) that widens each weight
  tile from e4m3 to the activations' dtype in registers (the GPU's conversion instructions where it has
  them); the activations are not quantized. Without triton, the path below.
- CPU (and the rest): each block of DEQUANTIZE_CHUNK_ROWS weight rows widened to the activations' dtype
  per call and multiplied by PyTorch; the scale applied to the output. It keeps 1 byte per weight in
  memory but is slower than the float model (docs/models.md): for testing and memory, not speed.

The row threshold and the Triton tile shapes were measured on an H200 (docs/models.md, FP8 weights).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F

from inflight.engine.attention.kv_store import FP8_DTYPE, FP8_MAX
from inflight.engine.attention.triton_paged import triton_available, triton_interpreting

# torch._scaled_mm's row-wise FP8 GEMM: the first compute capability with FP8 tensor cores, and the
# multiple its inner and output sizes must be.
SCALED_MM_CAPABILITY = (8, 9)
SCALED_MM_ALIGNMENT = 16
# Weight rows widened at a time on the dequantizing path: bounds the float copy of a large projection.
DEQUANTIZE_CHUNK_ROWS = 8192
# Below this an activation row's scale is not divided by (an all-zero row).
MIN_ACTIVATION_SCALE = 1e-12
# At or below this many rows the weight-only Triton kernel runs even where _scaled_mm could: it reads the
# FP8 weight once, with no activation quantization launched before it (H200: 1.1-1.5x bfloat16 at 1 and
# 16 rows, where quantize + _scaled_mm ran at 0.5-1.2x).
WEIGHT_ONLY_MAX_ROWS = 16
# Triton tiles of fp8_linear_kernel by row count: (most rows, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages);
# the last entry serves any larger count. NATIVE_TILES (FP8 conversion instructions): the fastest of ten
# configurations on an H200 per row count. PORTABLE_TILES (integer decoding: GPUs before compute
# capability 8.9, whose shared memory can be 64 KB a block, and the interpreter): small tiles.
Tiles = tuple[tuple[int | None, int, int, int, int, int], ...]
NATIVE_TILES: Tiles = (
    (16, 16, 32, 256, 4, 4),
    (64, 16, 64, 256, 4, 3),
    (None, 128, 128, 64, 8, 3),
)
PORTABLE_TILES: Tiles = (
    (16, 16, 64, 64, 4, 3),
    (None, 64, 64, 64, 4, 3),
)
# Columns of an activation row quantize_rows_kernel reads at a time.
QUANTIZE_BLOCK_K = 1024


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] times `weight` (float8 e4m3 [out, in]) scaled by `scale` (float32 [out]), plus `bias`;
    in x's dtype."""
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features)
    weight_only = triton_available() and x2.shape[0] <= WEIGHT_ONLY_MAX_ROWS
    if x.is_cuda and uses_scaled_mm(x, weight) and not weight_only:
        out = scaled_mm_linear(x2, weight, scale)
    elif x.is_cuda and triton_available():
        out = triton_linear(x2, weight, scale)
    else:
        out = dequantized_linear(x2, weight, scale)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


@cache
def fp8_tensor_cores(device_index: int) -> bool:
    """True where CUDA device `device_index` multiplies FP8 matrices natively (compute capability >= 8.9)."""
    return torch.cuda.get_device_capability(device_index) >= SCALED_MM_CAPABILITY


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where torch._scaled_mm runs this product: FP8 tensor cores, bfloat16 activations (its row-wise
    kernel writes bfloat16) and sizes that are multiples of SCALED_MM_ALIGNMENT."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and all(size % SCALED_MM_ALIGNMENT == 0 for size in weight.shape)
        and fp8_tensor_cores(x.get_device())
    )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 values and a float32 scale per row [M, 1] (row amax / 448): one Triton kernel on
    CUDA, PyTorch's element-wise operations elsewhere (the same values)."""
    if not (x.is_cuda and triton_available()):
        return quantize_activations_torch(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, k = x.shape
    values = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _kernels().quantize_rows_kernel[(rows,)](
        x,
        values,
        scales,
        k,
        x.stride(0),
        FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_ACTIVATION_SCALE,
        BLOCK_K=QUANTIZE_BLOCK_K,
    )
    return values, scales


def quantize_activations_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations by PyTorch operations (seven kernel launches on a GPU)."""
    x_float = x.float()
    x_scale = (x_float.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_ACTIVATION_SCALE)
    return (x_float / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), x_scale


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16, CUDA) W^T on FP8 tensor cores, per-token activation scales."""
    x_fp8, x_scale = quantize_activations(x)
    # mat2 must be column-major: W [N, K] row-major, transposed.
    out: torch.Tensor = torch._scaled_mm(
        x_fp8, weight.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype
    )
    return out


def dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] W^T with W's rows widened to x's dtype DEQUANTIZE_CHUNK_ROWS at a time."""
    rows = weight.shape[0]
    parts = [
        (
            F.linear(x, weight[start : start + DEQUANTIZE_CHUNK_ROWS].to(x.dtype))
            * scale[start : start + DEQUANTIZE_CHUNK_ROWS]
        ).to(x.dtype)
        for start in range(0, rows, DEQUANTIZE_CHUNK_ROWS)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


@cache
def _kernels() -> ModuleType:
    from inflight.engine.fp8 import triton_kernels

    return triton_kernels


def triton_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] W^T by the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    kernels = _kernels()
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty((m, n))
    interpreting = triton_interpreting()
    native = not interpreting and fp8_tensor_cores(x.get_device())
    block_m, block_n, block_k, warps, stages = next(
        tile[1:] for tile in (NATIVE_TILES if native else PORTABLE_TILES) if tile[0] is None or m <= tile[0]
    )
    grid = (-(-m // block_m), -(-n // block_n))
    kernels.fp8_linear_kernel[grid](
        x,
        weight.contiguous().view(torch.uint8),
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        k,
        out.stride(0),
        # Triton's interpreter cannot multiply bfloat16 matrices: there, products in float32.
        DOT_IN_FP32=x.dtype == torch.float32 or interpreting,
        NATIVE_FP8=native,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out
