"""The fused CPU kernels behind model/ops.py against the PyTorch code they replace."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.model import ops

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason=f"CPU kernels not built: {cpu_kernels.unavailable_reason()}"
)

T = TypeVar("T")
# float32 within a few ulps; bfloat16 within one rounding step of values around 1-4.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


def reference(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], T]) -> T:
    """fn() with the kernels switched off: the PyTorch code."""
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "library", lambda: None)
        return fn()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 320: enough elements to split over threads
@pytest.mark.parametrize("hidden", [320, 100])  # bfloat16 rows of 16-element vectors, and a tail
def test_rms_norm_with_and_without_residual(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int, hidden: int, torch_threads: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)

    out, same = ops.rms_norm(x, weight, 1e-5)
    expected, _ = reference(monkeypatch, lambda: ops.rms_norm(x, weight, 1e-5))
    assert same is x
    assert_close(out, expected)

    expected, expected_sum = reference(monkeypatch, lambda: ops.rms_norm(x, weight, 1e-5, residual.clone()))
    out, summed = ops.rms_norm(x, weight, 1e-5, residual)
    assert summed is residual  # added in place
    assert_close(summed, expected_sum)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("width", [352, 90])
def test_silu_and_mul(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int, width: int, torch_threads: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0, -0.0])  # saturation and zero
    out = ops.silu_and_mul(gate_up)
    assert_close(out, reference(monkeypatch, lambda: ops.silu_and_mul(gate_up)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (6, 6, 8)])
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads)
    tokens = 9
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    args = (num_heads, num_kv_heads, head_dim, cos, sin)
    expected = reference(monkeypatch, lambda: ops.split_qkv_with_rotary(qkv.clone(), *args))
    original_v = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    q, k, v = ops.split_qkv_with_rotary(qkv, *args)
    assert q.data_ptr() == qkv.data_ptr()  # views of the projection, rotated where they lie
    for actual, wanted in zip((q, k, v), expected, strict=True):
        assert_close(actual, wanted)
    assert torch.equal(v.reshape(tokens, -1), original_v)


def test_float16_uses_the_pytorch_code() -> None:
    x = torch.randn(3, 64).half()
    gate_up = torch.randn(3, 128).half()
    out, _ = ops.rms_norm(x, torch.ones(64).half(), 1e-5)
    expected = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out, expected.half())
    torch.testing.assert_close(
        ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:]
    )
