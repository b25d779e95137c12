"""Dequantize GGUF tensor data (llama.cpp's block formats) with vectorized torch ops.

Each function takes the raw bytes of a tensor as a (num_blocks, bytes_per_block) uint8 tensor and
returns float32 values, (num_blocks, values_per_block), computed in the same order as the `gguf`
package's numpy reference so the results are bit-identical (tests/engine/gguf/test_dequant.py). Types without
a kernel here but with a dequantizer in the `gguf` package (Q2_K, Q3_K, the IQ types) go through that
numpy reference; anything else is refused with its name.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from inflight.engine.model.errors import ModelLoadError

QK_K = 256


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as a (num_blocks, 1) float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Low nibbles of each `width`-byte group, then its high nibbles: (num_blocks, groups, 2 * width)."""
    grouped = packed.reshape(packed.shape[0], -1, 1, width)
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return ((grouped >> shifts) & 0x0F).reshape(packed.shape[0], -1, 2 * width)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: bit i of the block's little-endian uint32 is the fifth bit of value i: (num_blocks, 32)."""
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8)
    return ((qh.reshape(qh.shape[0], 4, 1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:], 16).reshape(blocks.shape[0], 32).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:], 16).reshape(blocks.shape[0], 32).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 6:], 16).reshape(blocks.shape[0], 32)
    q = (low | (_fifth_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return _f16(blocks, 0) * q.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 8:], 16).reshape(blocks.shape[0], 32)
    q = (low | (_fifth_bits(blocks[:, 4:8]) << 4)).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block (12 bytes), as float32."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales).reshape(n, -1, 1)
    dm = (_f16(blocks, 2) * mins).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales).reshape(n, -1, 1)
    dm = (_f16(blocks, 2) * mins).reshape(n, -1, 1)
    low = _nibbles(blocks[:, 48:], 32).reshape(n, -1, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
    high = ((blocks[:, 16:48].reshape(n, 1, 1, 32) >> shifts) & 1).reshape(n, -1, 32)
    q = (low | (high << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (d * q).reshape(n, QK_K)


BLOCK_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
PLAIN_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
# Dequantized by the gguf package's numpy code (correct, but single-threaded and slower).
REFERENCE_TYPES = (
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.IQ1_S,
    GGMLQuantizationType.IQ1_M,
    GGMLQuantizationType.IQ2_XXS,
    GGMLQuantizationType.IQ2_XS,
    GGMLQuantizationType.IQ2_S,
    GGMLQuantizationType.IQ3_XXS,
    GGMLQuantizationType.IQ3_S,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.IQ4_XS,
)
SUPPORTED_TYPES = (*PLAIN_TYPES, *BLOCK_KERNELS, *REFERENCE_TYPES)
# Rows dequantized at a time: bounds the float32 temporaries for a large embedding matrix.
CHUNK_BLOCKS = 1 << 16


def type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def supported_type_names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` (row-major, torch order) stored in `raw` (its bytes) as ggml type `qtype`.

    Raises ModelLoadError naming the type when it is not one inflight can dequantize.
    """
    try:
        kind = GGMLQuantizationType(qtype)
    except ValueError:
        kind = None
    if kind is None or kind not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"GGUF tensor type {type_name(qtype)} is not supported; inflight reads {supported_type_names()}."
        )
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    numel = int(np.prod(shape))
    if kind in PLAIN_TYPES:
        values = data.view(PLAIN_TYPES[kind])
        return values[:numel].reshape(shape).to(dtype)
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    if data.numel() % block_bytes or numel != data.numel() // block_bytes * block_values:
        raise ModelLoadError(
            f"GGUF tensor of type {kind.name}: {data.numel()} bytes do not hold {numel} values "
            f"({block_values} values per {block_bytes}-byte block); the file is corrupt."
        )
    blocks = data.reshape(-1, block_bytes)
    out = torch.empty((blocks.shape[0], block_values), dtype=dtype)
    kernel = BLOCK_KERNELS.get(kind)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        chunk = blocks[start : start + CHUNK_BLOCKS]
        if kernel is not None:
            values = kernel(chunk)
        else:
            values = torch.from_numpy(gguf_quants.dequantize(chunk.numpy(), kind).reshape(chunk.shape[0], -1))
        out[start : start + CHUNK_BLOCKS] = values
    return out.reshape(shape)
