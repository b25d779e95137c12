"""Triton paged-attention kernels against a dense float64 reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from inflight.engine.attention import triton_paged

from support.paged_cases import dense_reference, make_case

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    error = (actual.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max abs error {error} > {TOLERANCE[dtype]} for {dtype}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)])
def test_decode_ragged_lengths_across_block_boundaries(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    # 1 token, exactly one block, one past a block, exactly two blocks, several tiles of BLOCK_N.
    seq_lens = [1, 16, 17, 32, 141]
    case = make_case(
        seq_lens, [1] * len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype
    )
    out = triton_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_split_k_matches_single_pass(num_splits: int) -> None:
    # The short sequence leaves later splits empty; the reduce must ignore them.
    case = make_case([300, 70, 5], [1, 1, 1], num_heads=4, num_kv_heads=1, block_size=8, dtype=torch.float16)
    expected = dense_reference(case)
    split = triton_paged.paged_attention(
        case.query, case.k_cache, case.v_cache, case.meta, case.scale, num_splits=num_splits
    )
    assert_close(split, expected, torch.float16)
    single = triton_paged.paged_attention(
        case.query, case.k_cache, case.v_cache, case.meta, case.scale, num_splits=1
    )
    assert_close(single, expected, torch.float16)


def test_split_k_is_chosen_for_long_contexts_with_few_programs() -> None:
    device = torch.device("cpu")
    assert triton_paged.choose_num_splits(num_programs=2, max_seq_len=4096, device=device) > 1
    assert triton_paged.choose_num_splits(num_programs=2, max_seq_len=100, device=device) == 1
    assert triton_paged.choose_num_splits(num_programs=10_000, max_seq_len=32_768, device=device) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_mixed_prefill_chunked_prefill_and_decode(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    # A decode, a chunk after a cached prefix that ends mid-block, a whole prompt, a 1-token prompt.
    seq_lens = [40, 37, 70, 1]
    query_lens = [1, 13, 70, 1]
    case = make_case(
        seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, seed=1
    )
    out = triton_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("query_lens", [[1, 1], [9, 30]])
def test_sliding_window_masks_old_keys(query_lens: list[int]) -> None:
    case = make_case([90, 45], query_lens, num_heads=4, num_kv_heads=2, sliding_window=20, seed=2)
    out = triton_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    expected = dense_reference(case)
    assert_close(out, expected, torch.float32)
    case.meta.sliding_window = None
    assert (dense_reference(case) - expected).abs().max() > 1e-2  # the window changed the answer


def test_odd_head_dim_and_block_size() -> None:
    case = make_case([23, 5], [3, 1], num_heads=6, num_kv_heads=3, head_dim=24, block_size=5, seed=3)
    out = triton_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_stores_through_slot_mapping(dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # Key and value as strided views of one fused projection, as a model produces them.
    fused = torch.randn(5, 2 * num_kv_heads * head_dim).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(5, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim :].view(5, num_kv_heads, head_dim)
    slots = torch.tensor([3, 4, 17, -1, 23], dtype=torch.int64)  # -1: a padding token, not written
    triton_paged.write_kv_cache(key, value, k_cache, v_cache, slots)

    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    written = [0, 1, 2, 4]
    assert torch.equal(flat_k[slots[written]], key[written])
    assert torch.equal(flat_v[slots[written]], value[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_write_then_attend_equals_reference() -> None:
    case = make_case([20, 33], [20, 1], num_heads=4, num_kv_heads=2, seed=4)
    key = torch.randn(21, 2, 32)
    value = torch.randn(21, 2, 32)
    triton_paged.write_kv_cache(key, value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = triton_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_paged_reference(dtype: torch.dtype) -> None:
    from inflight.engine.attention import torch_paged

    case = make_case([50, 1, 33, 80], [1, 1, 33, 16], num_heads=8, num_kv_heads=2, dtype=dtype, seed=5)
    args = (case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    expected = torch_paged.paged_attention(*args).double()
    assert_close(triton_paged.paged_attention(*args), expected, dtype)


def test_backend_uses_triton_on_cuda_only() -> None:
    from inflight.engine.attention.backend import get_attention_backend

    assert get_attention_backend(torch.device("cpu")).name in ("cpu-kernel", "torch")
    cuda = get_attention_backend(torch.device("cuda"))
    assert cuda.name == "triton"
    assert cuda.paged_attention is triton_paged.paged_attention


def test_torch_paged_gather_buffers_work_in_and_out_of_inference_mode() -> None:
    from inflight.engine.attention import torch_paged

    case = make_case([40, 9], [1, 1], num_heads=4, num_kv_heads=2, seed=6)
    args = (case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    with torch.inference_mode():
        inside = torch_paged.paged_attention(*args).clone()
    with torch.no_grad():
        outside = torch_paged.paged_attention(*args)
    assert torch.equal(inside, outside)
    assert_close(outside, dense_reference(case), torch.float32)
