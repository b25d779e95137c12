"""The Triton kernel of FP8-weight products on GPUs without FP8 tensor cores (engine/fp8/linear.py).
Imported only where triton is installed.

`fp8_linear_kernel`: out [M, N] = (x [M, K] W8^T) * scale [N]. A program owns a BLOCK_M x BLOCK_N output
tile; per BLOCK_K step it loads the activations and the weight tile as bytes, decodes the bytes from e4m3
with integer operations (`e4m3_to_float`: no FP8 conversion instruction is needed, so it runs on any
GPU and in Triton's interpreter), and multiplies in the activations' dtype, accumulating in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def e4m3_to_float(bits: tl.tensor) -> tl.tensor:
    """Bytes (uint32 0..255) holding float8 e4m3fn values as float32 (1 sign, 4 exponent bits with bias
    7, 3 mantissa bits; exponent 0: subnormals m * 2^-9). The NaN byte is never stored by quantization."""
    sign = (bits & 0x80) << 24
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    # Rebias the exponent 7 -> 127, move the 3 mantissa bits to the top of float32's 23.
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def fp8_linear_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: int,
    N: int,
    K: int,
    stride_xm: int,
    stride_wn: int,
    stride_om: int,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + inner
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        # The weight tile transposed: [BLOCK_K, BLOCK_N] of W [N, K].
        bits = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None],
            mask=(cols[None, :] < N) & (k[:, None] < K),
            other=0,
        )
        w = e4m3_to_float(bits.to(tl.uint32))
        if DOT_IN_FP32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
    acc = acc * scale[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )
