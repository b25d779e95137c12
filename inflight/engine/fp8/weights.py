"""FP8 weights: float8 e4m3 values with one float32 scale per output channel (row), W = scale * W8.

`--quantization fp8` quantizes a float checkpoint's decoder projections at load (scale = row amax / 448,
round to nearest); an FP8 checkpoint's own float8 values are kept as they are (engine/fp8/checkpoint.py).
`Fp8Linear` replaces the nn.Linear of each quantized projection; the loader fills it row by row through
`Fp8Weight`, a view of its two parameters whose rows slice like a float weight's (the fused q/k/v and
gate/up). A tensor-parallel rank's part of a checkpoint tensor is read by engine/fp8/checkpoint.py: rows
with their scales, or columns with every row's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inflight.engine.attention.kv_store import FP8_DTYPE, FP8_MAX
from inflight.engine.fp8.linear import fp8_linear


@dataclass
class Fp8Weight:
    """A [rows, cols] matrix: float8 e4m3 `values` and a float32 `scale` [rows]."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.values.shape
        return rows, cols

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scale.numel() * 4

    def __getitem__(self, rows: slice) -> Fp8Weight:
        """Rows `rows` (views, like a tensor's)."""
        return Fp8Weight(self.values[rows], self.scale[rows])

    def copy_(self, source: Fp8Weight) -> Fp8Weight:
        if source.shape != self.shape:
            raise ValueError(f"cannot copy a {source.shape} FP8 matrix into {self.shape}")
        self.values.copy_(source.values)
        self.scale.copy_(source.scale)
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix: the definition of what the products multiply by."""
        return (self.values.float() * self.scale.float()[:, None]).to(dtype)


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Per output row: scale = amax / 448 (1 for an all-zero row), values rounded to nearest e4m3."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(values, scale)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W an FP8 matrix (the bias stays a float parameter)."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = bias

    @property
    def fp8_weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, format=fp8, "
            f"bias={self.bias is not None}"
        )
