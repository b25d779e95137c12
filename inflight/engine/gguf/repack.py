"""GGUF blocks as the CPU kernels' QuantizedTensors (engine/cpu/quantized.py), repacked once at load:
float16 scales stay float16 (the bytes the file holds), Q4_0's offset becomes -8 x its scale (exact in
float16), Q4_K's sub-blocks become u4 blocks of 32 with their nibbles in Q4_0's order and float32 scales
and offsets (a float16 super-block scale times a 6-bit sub-block scale needs up to 17 bits). The values
are exactly the float32 ones dequant.py computes (tests/engine/test_quantized.py). Float weights
quantized at load (`--quantization int8|q8_0|q4_0|q4_1`) go through here too.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from inflight.engine.cpu.quant_layout import Layout
from inflight.engine.cpu.quantized import QuantizedTensor, quantize_int8
from inflight.engine.gguf.dequant import _f16, _k_scales_mins
from inflight.engine.quantization import CPU_LAYOUTS

# GGUF tensor types kept quantized, and the kernel layout each is repacked into (its format's).
KEPT_GGUF_TYPES: dict[GGMLQuantizationType, Layout] = {
    GGMLQuantizationType.Q8_0: CPU_LAYOUTS["q8_0"],
    GGMLQuantizationType.Q4_0: CPU_LAYOUTS["q4_0"],
    GGMLQuantizationType.Q4_1: CPU_LAYOUTS["q4_1"],
    GGMLQuantizationType.Q4_K: CPU_LAYOUTS["q4_k"],
}


def from_gguf_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedTensor:
    """The [rows, cols] matrix stored in `raw` (its bytes) as GGUF type `qtype` (one of KEPT_GGUF_TYPES)."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    if data.numel() != rows * cols // block_values * block_bytes:
        raise ValueError(f"{qtype.name}: {data.numel()} bytes do not hold a {rows} x {cols} matrix")
    blocks = data.reshape(rows * cols // block_values, block_bytes)

    def f16(start: int) -> torch.Tensor:
        return blocks[:, start : start + 2].contiguous().view(torch.float16).reshape(rows, -1)

    if qtype == GGMLQuantizationType.Q8_0:
        return QuantizedTensor("s8", blocks[:, 2:].reshape(rows, -1).contiguous(), f16(0), None)
    if qtype == GGMLQuantizationType.Q4_0:
        scales = f16(0)
        # -8 x a float16 is a float16 unless it overflows (|scale| > 8188): float32 then.
        offsets = -8.0 * scales.float()
        if not torch.equal(offsets.half().float(), offsets):
            scales = scales.float()
        return QuantizedTensor(
            "u4", blocks[:, 2:].reshape(rows, -1).contiguous(), scales, offsets.to(scales.dtype)
        )
    if qtype == GGMLQuantizationType.Q4_1:
        return QuantizedTensor("u4", blocks[:, 4:].reshape(rows, -1).contiguous(), f16(0), f16(2))
    if qtype == GGMLQuantizationType.Q4_K:
        return _from_q4_k(blocks, rows)
    raise ValueError(f"GGUF type {qtype.name} is not kept quantized")


def _from_q4_k(blocks: torch.Tensor, rows: int) -> QuantizedTensor:
    """Q4_K super-blocks (256 values: 8 sub-blocks with 6-bit scales and mins) as u4 blocks of 32, with the
    same float32 arithmetic as dequant._q4_k (scale d * sc, offset -(dmin * m))."""
    n = blocks.shape[0]
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    scales = _f16(blocks, 0) * sc  # [n, 8]
    mins = -(_f16(blocks, 2) * mn)
    # Each 32-byte group holds sub-block 2g in its low nibbles and 2g + 1 in its high ones; Q4_0's order
    # wants values j and j + 16 of one sub-block in byte j.
    groups = blocks[:, 16:].reshape(n, 4, 32)
    values = torch.stack([groups & 0x0F, groups >> 4], dim=2).reshape(n, 8, 32)
    packed = values[..., :16] | (values[..., 16:] << 4)
    return QuantizedTensor("u4", packed.reshape(rows, -1).contiguous(), scales.reshape(rows, -1),
                           mins.reshape(rows, -1))  # fmt: skip


def quantize_gguf(weight: torch.Tensor, qtype: GGMLQuantizationType) -> QuantizedTensor:
    """`weight` quantized to GGUF type `qtype` (the gguf package's reference quantizer: what a converted
    file would hold), then repacked."""
    raw = gguf_quants.quantize(weight.detach().float().numpy(), qtype)
    rows, cols = weight.shape
    return from_gguf_blocks(raw, qtype, (rows, cols))


LOAD_TIME_GGUF_TYPES = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
}


def quantize(weight: torch.Tensor, quantization: str) -> QuantizedTensor:
    """Float `weight` [rows, cols] in the load-time format `quantization` (int8, q8_0, q4_0, q4_1)."""
    if quantization == "int8":
        return quantize_int8(weight)
    return quantize_gguf(weight, LOAD_TIME_GGUF_TYPES[quantization])
