"""An FP8 (e4m3) KV cache through every paged-attention path: the torch reference, the C kernels (as built
here and each portable build) and the Triton kernels (interpreted on CPU).

Each path must agree with a float64 reference over the SAME float8 caches widened to float (widening
e4m3 is exact): with float32 queries within 1e-5 of the output's largest value (1e-4 for Triton), the
float path's own tolerance, so any error in reading the float8 bytes shows; with bfloat16 queries within
bfloat16's tolerance. Writing
must store exactly the bytes of kv_store.to_cache (saturated at +-448, rounded to nearest even).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from engine.attention.test_cpu_paged import portable_library

from inflight.engine.attention import cpu_paged, torch_paged, triton_paged
from inflight.engine.attention.kv_store import FP8_DTYPE, FP8_MAX, to_cache
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels

from support.paged_cases import PagedCase, dense_reference, make_case

__all__ = ["portable_library"]  # the C kernels of each portable build (a fixture of test_cpu_paged)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
TRITON_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
needs_kernels = pytest.mark.skipif(
    not cpu_paged.kernel_available(), reason=f"CPU kernels not built: {cpu_kernels.unavailable_reason()}"
)


def fp8_case(seq_lens: list[int], query_lens: list[int], dtype: torch.dtype, **shape: int) -> PagedCase:
    """A paged case whose caches are float8: values spread over e4m3's range (x 8: some saturate at 448,
    some are subnormal) are stored as the writers store them."""
    case = make_case(seq_lens, query_lens, dtype=dtype, **shape)
    gen = torch.Generator().manual_seed(3)
    spread = torch.exp2(torch.randint(-12, 7, case.k_cache.shape, generator=gen).float())
    k_cache = to_cache(case.k_cache.float() * spread, FP8_DTYPE)
    v_cache = to_cache(case.v_cache.float() * spread.flip(0), FP8_DTYPE)
    # Keys up to 448 would make every softmax one-hot: scale the queries down so the weights spread.
    return replace(case, k_cache=k_cache, v_cache=v_cache, scale=case.scale / 64)


def widened(case: PagedCase) -> PagedCase:
    """The reference's view: the same caches as float32."""
    return replace(case, k_cache=case.k_cache.float(), v_cache=case.v_cache.float())


def max_error(attention: Attention, case: PagedCase) -> float:
    """The largest error relative to the output's scale (values reach 448, not 1 as in the float tests)."""
    out = attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == case.query.dtype
    expected = dense_reference(widened(case))
    return float((out.double() - expected).abs().max() / expected.abs().max().clamp(min=1))


CASES = [  # seq_lens, query_lens, sliding window
    ([1, 16, 17, 32, 8, 9, 141], [1] * 7, None),
    ([1, 16, 17, 32, 8, 9, 141], [1, 16, 5, 32, 1, 9, 70], None),
    ([90, 45, 40, 3], [40, 1, 40, 3], 20),
]
SHAPES = [(8, 2, 32), (9, 3, 64), (8, 1, 24)]  # num_heads, num_kv_heads, head_dim (24: no wide path)


def check_path(attention: Attention, dtype: torch.dtype, tolerance: float) -> None:
    for seq_lens, query_lens, window in CASES:
        for num_heads, num_kv_heads, head_dim in SHAPES:
            case = fp8_case(
                seq_lens, query_lens, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
            )
            case.meta.sliding_window = window
            error = max_error(attention, case)
            assert error <= tolerance, (
                f"{seq_lens} {query_lens} {num_heads}/{num_kv_heads}x{head_dim}: {error}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_reads_float8_caches(dtype: torch.dtype) -> None:
    check_path(torch_paged.paged_attention, dtype, TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernels_read_float8_caches(dtype: torch.dtype, torch_threads: int) -> None:
    check_path(cpu_paged.paged_attention, dtype, TOLERANCE[dtype])


@needs_kernels
def test_c_kernels_read_float8_caches_in_every_build(
    portable_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_kernels, "library", lambda: portable_library)
    check_path(cpu_paged.paged_attention, torch.float32, 2 * TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_read_float8_caches(dtype: torch.dtype) -> None:
    check_path(triton_paged.paged_attention, dtype, TRITON_TOLERANCE[dtype])


def every_code_case() -> tuple[PagedCase, torch.Tensor]:
    """One sequence of one token whose value row holds every finite e4m3 code (attention over one key is
    that value exactly), and those codes as floats."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    head_dim = 256
    row = torch.cat([codes, torch.zeros(head_dim - codes.numel(), dtype=torch.uint8)])
    case = make_case([1], [1], num_heads=1, num_kv_heads=1, head_dim=head_dim)
    v_cache = torch.zeros(case.v_cache.shape, dtype=torch.uint8)
    v_cache[case.meta.block_tables[0, 0].long(), 0, 0] = row
    k_cache = torch.zeros(case.k_cache.shape, dtype=FP8_DTYPE)
    return replace(case, k_cache=k_cache, v_cache=v_cache.view(FP8_DTYPE)), row.view(FP8_DTYPE).float()


@pytest.mark.parametrize("path", ["torch", "c", "triton"])
def test_every_float8_code_widens_exactly(path: str) -> None:
    if path == "c" and not cpu_paged.kernel_available():
        pytest.skip("CPU kernels not built")
    attention = {"torch": torch_paged, "c": cpu_paged, "triton": triton_paged}[path].paged_attention
    case, expected = every_code_case()
    out = attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.equal(out[0, 0], expected)


@needs_kernels
def test_every_float8_code_widens_exactly_in_every_build(
    portable_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_kernels, "library", lambda: portable_library)
    case, expected = every_code_case()
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.equal(out[0, 0], expected)


@pytest.mark.parametrize("path", ["torch", "c", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_store_the_saturated_float8_bytes(path: str, dtype: torch.dtype) -> None:
    if path == "c" and not cpu_paged.kernel_available():
        pytest.skip("CPU kernels not built")
    write = {"torch": torch_paged, "c": cpu_paged, "triton": triton_paged}[path].write_kv_cache
    gen = torch.Generator().manual_seed(5)
    # Rows of the fused q|k|v projection (not contiguous), values from 2^-12 to 2^10: subnormals, ties,
    # and values past 448 that must saturate.
    scales = torch.exp2(torch.tensor([-12.0, -8, -3, 0, 4, 8, 10]))[:, None]
    qkv = (torch.randn(7, (4 + 2 * 2) * 16, generator=gen) * scales).to(dtype)
    key = qkv[:, 64:96].view(7, 2, 16)
    value = qkv[:, 96:].view(7, 2, 16)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 0, 15, 7, 8, 12, 1])
    write(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(16, 2, 16), v_cache.view(16, 2, 16)
    for stored, rows in ((flat_k[slots], key), (flat_v[slots], value)):
        assert torch.equal(stored.view(torch.uint8), to_cache(rows, FP8_DTYPE).view(torch.uint8))
    assert flat_k.float().abs().max() == FP8_MAX  # the large rows saturated instead of becoming NaN
