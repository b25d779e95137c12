"""How keys and values become KV cache elements: the one rule every attention path follows.

A bfloat16/float16/float32 cache stores the values as cast. A float8 e4m3 cache (`--kv-cache-dtype
fp8`) stores them saturated to +-448 (e4m3's largest finite value; a plain cast would turn larger
values into NaN) and rounded to nearest even, with one scale per tensor that is 1.0: vLLM's default
when a checkpoint carries no calibrated scales (docs/models.md says why). Readers widen the elements
back to float exactly.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def to_cache(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`rows` as `cache_dtype` elements (saturated for float8)."""
    if cache_dtype == FP8_DTYPE:
        return rows.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return rows.to(cache_dtype)
