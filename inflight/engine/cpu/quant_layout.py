"""The quantized weights' block layout, defined once for both sides and for sizing (no torch):
quantized.py stores matrices in it, kernels.py compiles these values into quant_kernels.c
(`compile_definitions`: -D flags), which reads them (quant_kernels.c's top comment draws the interleaved
layout), and engine/quantization.py plans each format's bytes per weight from it (`Layout.bytes_per_weight`:
what sizing.py and `inflight size` count).

A block holds 32 consecutive values of one output row: 32 bytes (s8) or 16 (u4), plus its scale (and
u4's offset), float16 or float32 per matrix. A matrix is interleaved by groups of 16 output rows.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

KernelFormat = Literal["s8", "u4"]
ScaleDtype = Literal["float16", "float32"]
# Values per block.
BLOCK = 32
# Output rows interleaved together (one 512-bit vector holds a value of each).
GROUP = 16
FORMAT_CODES: dict[KernelFormat, int] = {"s8": 0, "u4": 1}
# Added to a format code when the matrix's scales (and offsets) are float16; float32 otherwise.
SCALES_FLOAT16 = 2
SCALE_BYTES: dict[ScaleDtype, int] = {"float16": 2, "float32": 4}
# Quantized bytes per block.
BLOCK_BYTES: dict[KernelFormat, int] = {"s8": BLOCK, "u4": BLOCK // 2}
# Float values per block beside the quantized bytes: a scale, and u4's offset.
BLOCK_FLOATS: dict[KernelFormat, int] = {"s8": 1, "u4": 2}
# s8 values are stored + 128 when interleaved (unsigned bytes: value q is byte q ^ 0x80).
S8_OFFSET = 0x80


def whole_blocks(columns: int) -> bool:
    """Whether a matrix with `columns` input features can be held in blocks (a multiple of BLOCK)."""
    return columns % BLOCK == 0


class Layout(NamedTuple):
    """How a matrix is stored: its format and its scales' dtype (quantized.py: the torch dtype of each)."""

    format: KernelFormat
    scale_dtype: ScaleDtype

    @property
    def kernel_code(self) -> int:
        """The `format` argument quant_kernels.c takes for a matrix in this layout."""
        return FORMAT_CODES[self.format] + (SCALES_FLOAT16 if self.scale_dtype == "float16" else 0)

    @property
    def bytes_per_weight(self) -> float:
        """Bytes held (and read by a product) per weight of a matrix in this layout: the quantized bytes
        and the scales (and offsets) of a block over its 32 values; the interleaved layout's zero rows up
        to a multiple of 16 aside."""
        floats = BLOCK_FLOATS[self.format] * SCALE_BYTES[self.scale_dtype]
        return (BLOCK_BYTES[self.format] + floats) / BLOCK


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
