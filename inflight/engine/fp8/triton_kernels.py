"""The Triton kernels of FP8-weight products on CUDA (engine/fp8/linear.py says which runs where).
Imported only where triton is installed.

`fp8_linear_kernel`: out [M, N] = (x [M, K] W8^T) * scale [N], the activations not quantized. A program owns
a BLOCK_M x BLOCK_N output tile; per BLOCK_K step it loads the activations and the weight tile as bytes and
widens the bytes from e4m3 to the activations' dtype in registers, multiplying in that dtype with float32
sums. NATIVE_FP8 widens with the GPU's FP8 conversion instructions (compute capability >= 8.9); without it
the bytes are decoded with integer operations (`e4m3_to_float`), which any GPU and Triton's interpreter run.

`quantize_rows_kernel`: each activation row as e4m3 values and its float32 scale (row amax / FP8_MAX), in
one launch instead of the seven element-wise PyTorch kernels; the same values as
`linear.quantize_activations_torch` bit for bit (benchmarks/fp8_gpu.py checks it on the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    NATIVE_FP8: tl.constexpr,
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
        if NATIVE_FP8:
            w = bits.to(tl.float8e4nv, bitcast=True).to(x.dtype)
        else:
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


@triton.jit
def quantize_rows_kernel(
    x_ptr: tl.tensor,
    values_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    K: int,
    stride_xm: int,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """Row program_id(0) of x [M, K]: values [M, K] = x / scale saturated to +-FP8_MAX, as e4m3 (rounded to
    nearest even); scales [M] = max(row amax / FP8_MAX, MIN_SCALE)."""
    row = tl.program_id(0).to(tl.int64)
    inner = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + inner
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + inner
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        value = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(values_ptr + row * K + k, value.to(values_ptr.dtype.element_ty), mask=k < K)
    tl.store(scales_ptr + row, scale)
