"""The quantized weights' block layout, defined once for both sides: quantized.py stores matrices in it,
and kernels.py compiles these values into quant_kernels.c (`compile_definitions`: -D flags), which reads
them (quant_kernels.c's top comment draws the interleaved layout).

A block holds 32 consecutive values of one output row: 32 bytes (s8) or 16 (u4), plus its scale (and
u4's offset), float16 or float32 per matrix. A matrix is interleaved by groups of 16 output rows.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

KernelFormat = Literal["s8", "u4"]
# Values per block.
BLOCK = 32
# Output rows interleaved together (one 512-bit vector holds a value of each).
GROUP = 16
FORMAT_CODES: dict[KernelFormat, int] = {"s8": 0, "u4": 1}
# Added to a format code when the matrix's scales (and offsets) are float16; float32 otherwise.
SCALES_FLOAT16 = 2
SCALE_DTYPES = (torch.float16, torch.float32)
# Quantized bytes per block.
BLOCK_BYTES: dict[KernelFormat, int] = {"s8": BLOCK, "u4": BLOCK // 2}
# Float values per block beside the quantized bytes: a scale, and u4's offset.
BLOCK_FLOATS: dict[KernelFormat, int] = {"s8": 1, "u4": 2}
# s8 values are stored + 128 when interleaved (unsigned bytes: value q is byte q ^ 0x80).
S8_OFFSET = 0x80


class Layout(NamedTuple):
    """How a matrix is stored: its format and its scales' dtype (float16 or float32)."""

    format: KernelFormat
    scale_dtype: torch.dtype


def kernel_code(format: KernelFormat, scale_dtype: torch.dtype) -> int:
    """The `format` argument quant_kernels.c takes for a matrix in `format` with `scale_dtype` scales."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"quantized scales are float16 or float32, not {scale_dtype}")
    return FORMAT_CODES[format] + (SCALES_FLOAT16 if scale_dtype == torch.float16 else 0)


def bytes_per_weight(format: KernelFormat, scale_dtype: torch.dtype) -> float:
    """Bytes a product reads per weight of a matrix in this layout (padding rows aside)."""
    scale_bytes = torch.finfo(scale_dtype).bits // 8
    return (BLOCK_BYTES[format] + BLOCK_FLOATS[format] * scale_bytes) / BLOCK


def compile_definitions() -> tuple[str, ...]:
    """The layout as the C compiler's -D flags (quant_kernels.c refuses to compile without them)."""
    values = {
        "QBLOCK": BLOCK,
        "QGROUP": GROUP,
        "QFORMAT_S8": FORMAT_CODES["s8"],
        "QFORMAT_U4": FORMAT_CODES["u4"],
        "QSCALES_F16": SCALES_FLOAT16,
        "QS8_OFFSET": S8_OFFSET,
    }
    return tuple(f"-D{name}={value}" for name, value in values.items())
