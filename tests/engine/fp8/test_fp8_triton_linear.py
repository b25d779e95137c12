"""The Triton FP8-weight kernel (engine/fp8/triton_kernels.py) under TRITON_INTERPRET=1 (conftest.py):
it decodes every e4m3 byte exactly, and its product is the dequantized float product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.engine.fp8.linear import triton_linear
from inflight.engine.fp8.weights import quantize_fp8


def test_every_e4m3_byte_decodes_to_its_value() -> None:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = values[~values.float().isnan()][:240].reshape(16, 15)
    weight = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    weight[:, :15] = values
    # The identity picks out W^T: out[m, n] = W[n, m].
    out = triton_linear(torch.eye(16), weight, torch.ones(16))
    assert torch.equal(out.t(), weight.float())


@pytest.mark.parametrize("rows", [1, 5, 33, 65])  # both of linear.PORTABLE_TILES, edge tiles
def test_the_product_is_the_dequantized_product(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    fp8 = quantize_fp8(torch.randn(72, 80, generator=gen))  # sizes off the 64 tiles: masked edges
    x = torch.randn(rows, 80, generator=gen)
    expected = F.linear(x, fp8.dequantize())
    out = triton_linear(x, fp8.values, fp8.scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
