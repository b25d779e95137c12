"""Our torch dequantization against the `gguf` package's numpy reference, on generated tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from inflight.engine.gguf.dequant import BLOCK_KERNELS, dequantize
from inflight.engine.model.errors import ModelLoadError

ROWS, COLS = 8, 512


def _random_blocks(kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random quantized bytes whose float16 scale fields hold finite, varied values."""
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(ROWS * COLS // block_values, block_bytes), dtype=np.uint8)
    # Where each block keeps its float16 scales (d, and dmin/m for the types that have one).
    scale_offsets = {
        GGMLQuantizationType.Q6_K: (208,),
        GGMLQuantizationType.Q4_K: (0, 2),
        GGMLQuantizationType.Q5_K: (0, 2),
        GGMLQuantizationType.Q4_1: (0, 2),
        GGMLQuantizationType.Q5_1: (0, 2),
    }.get(kind, (0,))
    for offset in scale_offsets:
        scales = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("kind", list(BLOCK_KERNELS), ids=lambda k: k.name)
def test_block_kernels_equal_the_gguf_reference_bit_for_bit(kind: GGMLQuantizationType) -> None:
    raw = _random_blocks(kind, np.random.default_rng(int(kind)))
    expected = gguf_quants.dequantize(raw, kind)
    ours = dequantize(raw, int(kind), (ROWS, COLS), torch.float32)
    assert expected.shape == (ROWS, COLS)
    assert torch.equal(ours, torch.from_numpy(expected))


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0])
def test_quantized_real_values_come_back_close(kind: GGMLQuantizationType) -> None:
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    raw = gguf_quants.quantize(values, kind)
    ours = dequantize(raw, int(kind), (ROWS, COLS), torch.float32).numpy()
    tolerance = 0.03 if kind == GGMLQuantizationType.Q8_0 else 0.5
    assert np.abs(ours - values).max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_types_convert_to_the_chosen_dtype(dtype: torch.dtype) -> None:
    values = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    for kind, stored in (
        (GGMLQuantizationType.F32, torch.from_numpy(values)),
        (GGMLQuantizationType.F16, torch.from_numpy(values.astype(np.float16))),
        (GGMLQuantizationType.BF16, torch.from_numpy(values).to(torch.bfloat16)),
    ):
        raw = stored.view(torch.uint8).numpy()
        ours = dequantize(raw, int(kind), (3, 64), dtype)
        assert ours.dtype == dtype
        assert torch.equal(ours, stored.to(dtype))


def test_types_without_a_kernel_use_the_reference() -> None:
    raw = _random_blocks(GGMLQuantizationType.Q3_K, np.random.default_rng(3))
    expected = gguf_quants.dequantize(raw, GGMLQuantizationType.Q3_K)
    ours = dequantize(raw, int(GGMLQuantizationType.Q3_K), (ROWS, COLS), torch.float32)
    # Q3_K's scale sits at the block's end, so the random bytes there may spell NaN: compare NaN-aware.
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_an_unsupported_type_is_named() -> None:
    with pytest.raises(ModelLoadError, match=r"Q8_K is not supported.*Q4_K"):
        dequantize(np.zeros(292, dtype=np.uint8), int(GGMLQuantizationType.Q8_K), (256,), torch.float32)
    with pytest.raises(ModelLoadError, match="unknown type 99"):
        dequantize(np.zeros(4, dtype=np.uint8), 99, (1,), torch.float32)
