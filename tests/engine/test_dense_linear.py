"""cpu/kernels.c's dense_linear (one to eight rows times float weights, float32 up to 24; bfloat16 up to 64
rows on the AMX tiles) and PrepackedLinear's use of it.

The plain C version (the portable build) defines the result bit for bit: every other build gives the
same bits, whatever the thread count and whatever the other rows of the batch are; except the tile
products (bfloat16, more than four rows, on CPUs with AMX-BF16), which are checked against float64 and
for the same independence of the thread count and the other rows."""

from __future__ import annotations

import ctypes

import pytest
import torch
from engine.attention.test_cpu_paged import any_library
from torch import nn

from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.linear import PrepackedLinear, can_prepack, dense_linear, dense_rows

__all__ = ["any_library"]  # the native kernels, then each portable build (a fixture of test_cpu_paged)

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason=f"CPU kernels not built: {cpu_kernels.unavailable_reason()}"
)

# (outputs, inputs): tails of every kind (outputs not a multiple of the 4-row tile, inputs not of 16 or
# 32 columns), and the shapes of a SmolLM2 layer's products.
SHAPES = [(7, 5), (37, 70), (130, 96), (33, 1537), (960, 576), (576, 1536)]
# float32 sums of up to 1537 products against float64; bfloat16 adds one rounding of the result.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2**-8}
# The most rows dense_linear takes with AVX-512 (DENSE_BFLOAT16_ROWS and DENSE_FLOAT32_ROWS in kernels.c), in
# passes of six over the same weight rows; ONE_PASS_ROWS: one pass of six and the rest in a second.
BFLOAT16_ROWS = 16
FLOAT32_ROWS = 24
ONE_PASS_ROWS = 8
# On the AMX tiles (bfloat16, inputs a multiple of 32): from 5 rows (more than DENSE_MAX_ROWS) to 64.
TILE_ROWS = (5, 64)
BFLOAT16 = cpu_kernels.DTYPE_CODES[torch.bfloat16]


def case(
    dtype: torch.dtype, rows: int, shape: tuple[int, int], scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    n, k = shape
    x = (torch.randn(rows, k, generator=gen) * scale).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    return x, weight, torch.randn(n, generator=gen).to(dtype)


@pytest.fixture(scope="module")
def plain_library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    flags = tuple(flag for flag in cpu_kernels.COMPILE_FLAGS if flag != "-march=native")
    out_dir = tmp_path_factory.getbasetemp() / "kernels-dense-plain"
    return cpu_kernels.load_library(cpu_kernels.build_library(out_dir=out_dir, flags=flags))


def on_tiles(library: ctypes.CDLL, dtype: torch.dtype, rows: int, k: int) -> bool:
    """Whether `library` multiplies `rows` rows of `dtype` by k inputs on the AMX tiles."""
    return (
        dtype == torch.bfloat16
        and TILE_ROWS[0] <= rows <= TILE_ROWS[1]
        and library.dense_linear_max_rows(BFLOAT16, k) == TILE_ROWS[1]
    )


@pytest.mark.parametrize(
    ("dtype", "rows"),
    [(torch.float32, rows) for rows in (*range(1, ONE_PASS_ROWS + 1), 13, FLOAT32_ROWS)]
    + [(torch.bfloat16, rows) for rows in (*range(1, ONE_PASS_ROWS + 1), 13, BFLOAT16_ROWS)],
)
def test_every_build_and_thread_count_gives_the_plain_c_bits(
    any_library: ctypes.CDLL, plain_library: ctypes.CDLL, dtype: torch.dtype, rows: int, torch_threads: int
) -> None:
    for shape in SHAPES:
        if on_tiles(any_library, dtype, rows, shape[1]):
            continue  # tile products: test_tile_products_*
        x, weight, bias = case(dtype, rows, shape)
        for b in (bias, None):
            with_threads = torch.get_num_threads()
            torch.set_num_threads(1)
            expected = dense_linear(x, weight, b, plain_library)
            torch.set_num_threads(with_threads)
            actual = dense_linear(x, weight, b, any_library)
            assert torch.equal(actual, expected), f"{shape}, bias {b is not None}"
            widened = dense_linear(x, weight, b, any_library, out_dtype=torch.float32)
            assert widened.dtype == torch.float32 and torch.equal(widened, expected.float())
            exact = nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
            torch.testing.assert_close(actual.double(), exact, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows(
    any_library: ctypes.CDLL, dtype: torch.dtype
) -> None:
    most = FLOAT32_ROWS if dtype == torch.float32 else BFLOAT16_ROWS
    for shape in SHAPES:
        if on_tiles(any_library, dtype, most, shape[1]):
            continue  # test_tile_products_do_not_depend_on_the_other_rows_or_the_threads
        x, weight, bias = case(dtype, most, shape)
        together = dense_linear(x, weight, bias, any_library)
        for r in range(most):
            assert torch.equal(together[r : r + 1], dense_linear(x[r : r + 1], weight, bias, any_library))
        for first, end in [(1, 3), (3, 7), (5, 8), (8, 16)] + ([(0, 17)] if most > 17 else []):
            part = dense_linear(x[first:end].contiguous(), weight, bias, any_library)
            assert torch.equal(together[first:end], part)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1e-20, 1e-19), (1e-39, 1.0), (1e-30, 1e-8)])
def test_products_and_values_below_the_normal_range(
    any_library: ctypes.CDLL, plain_library: ctypes.CDLL, dtype: torch.dtype, scales: tuple[float, float]
) -> None:
    """float32 keeps denormals; bfloat16 counts values and sums under 1.2e-38 as zero, as AVX512-BF16's
    dot product does, in the plain C version too."""
    x_scale, w_scale = scales
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 100, generator=gen) * x_scale).to(dtype)
    weight = (torch.randn(37, 100, generator=gen) * w_scale).to(dtype)
    actual = dense_linear(x, weight, None, any_library)
    assert torch.equal(actual, dense_linear(x, weight, None, plain_library))
    if dtype == torch.bfloat16 and x_scale * w_scale < 1e-38:
        assert not actual.any()
    else:
        assert actual.all()


# (outputs, inputs): fewer outputs than a tile's 16, tails past 16 and past 32 outputs, SmolLM2's products.
TILE_SHAPES = [(7, 64), (37, 96), (130, 96), (960, 576), (576, 1536)]


def tile_library(any_library: ctypes.CDLL) -> ctypes.CDLL:
    if not on_tiles(any_library, torch.bfloat16, TILE_ROWS[1], 64):
        pytest.skip("this build does not multiply on AMX tiles (CPU without AMX-BF16, or not permitted)")
    return any_library


@pytest.mark.parametrize("rows", [5, 9, 16, 17, 33, 64])
def test_tile_products_equal_float64_within_bfloat16_rounding(any_library: ctypes.CDLL, rows: int) -> None:
    library = tile_library(any_library)
    for shape in TILE_SHAPES:
        x, weight, bias = case(torch.bfloat16, rows, shape)
        for b in (bias, None):
            actual = dense_linear(x, weight, b, library)
            widened = dense_linear(x, weight, b, library, out_dtype=torch.float32)
            assert widened.dtype == torch.float32 and torch.equal(widened, actual.float())
            exact = nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
            tolerance = TOLERANCE[torch.bfloat16]
            torch.testing.assert_close(actual.double(), exact, rtol=tolerance, atol=tolerance)


def test_tile_products_do_not_depend_on_the_other_rows_or_the_threads(
    any_library: ctypes.CDLL, torch_threads: int
) -> None:
    library = tile_library(any_library)
    for shape in TILE_SHAPES:
        x, weight, bias = case(torch.bfloat16, TILE_ROWS[1], shape)
        together = dense_linear(x, weight, bias, library)
        with_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        assert torch.equal(dense_linear(x, weight, bias, library), together)
        torch.set_num_threads(with_threads)
        for first, end in ((0, 5), (3, 20), (20, 53), (59, 64)):
            part = dense_linear(x[first:end].contiguous(), weight, bias, library)
            assert torch.equal(together[first:end], part), f"{shape}, rows {first}:{end}"


def test_tiles_take_inputs_in_whole_steps_of_32_and_at_most_64_rows(any_library: ctypes.CDLL) -> None:
    library = tile_library(any_library)
    assert library.dense_linear_max_rows(BFLOAT16, 70) == BFLOAT16_ROWS  # 70 inputs: the AVX-512 rows only
    x, weight, _ = case(torch.bfloat16, TILE_ROWS[1] + 1, (8, 64))
    out = torch.empty(TILE_ROWS[1] + 1, 8, dtype=torch.bfloat16)
    args = (weight.data_ptr(), 8, None, BFLOAT16, out.data_ptr(), BFLOAT16, 1)
    assert library.dense_linear(x.data_ptr(), TILE_ROWS[1] + 1, 64, *args) == -1
    assert library.dense_linear(x.data_ptr(), TILE_ROWS[1], 64, *args) == 0
    assert library.dense_linear(x[:, :48].contiguous().data_ptr(), BFLOAT16_ROWS + 1, 48, *args) == -1


@pytest.mark.parametrize(("dtype", "most"), [(torch.float32, FLOAT32_ROWS), (torch.bfloat16, BFLOAT16_ROWS)])
def test_more_rows_than_it_takes_are_refused(any_library: ctypes.CDLL, dtype: torch.dtype, most: int) -> None:
    """16 inputs: not the AMX tiles' (whole steps of 32), so bfloat16 takes AVX-512's 16 rows at most."""
    x, weight, bias = case(dtype, most + 1, (8, 16))
    out = torch.empty(most + 1, 8, dtype=dtype)
    code = cpu_kernels.DTYPE_CODES[dtype]
    args = (weight.data_ptr(), 8, bias.data_ptr(), code, out.data_ptr(), code, 1)
    assert any_library.dense_linear(x.data_ptr(), most + 1, 16, *args) == -1
    assert any_library.dense_linear(x.data_ptr(), 0, 16, *args) == -1
    assert any_library.dense_linear(x.data_ptr(), most, 16, *args) == 0


def test_a_float32_product_into_bfloat16_is_refused(any_library: ctypes.CDLL) -> None:
    """The output dtype is the inputs' or float32 (the bfloat16 result widened), never narrower."""
    x, weight, bias = case(torch.float32, 2, (8, 16))
    with pytest.raises(ValueError, match=r"into torch\.bfloat16"):
        dense_linear(x, weight, bias, any_library, out_dtype=torch.bfloat16)


def native_dtypes() -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if can_prepack(torch.device("cpu"), d)]


@pytest.mark.parametrize("dtype", native_dtypes())
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_multiplies_a_few_rows_in_c_and_more_with_onednn(
    dtype: torch.dtype, bias: bool
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias).to(dtype)
    packed = PrepackedLinear(linear, batch_size_hint=64)
    assert packed.dense_rows == dense_rows(linear.weight, linear.bias)
    assert packed.dense_rows in (0, BFLOAT16_ROWS, FLOAT32_ROWS, TILE_ROWS[1])
    x = torch.randn(packed.dense_rows + 1, 96).to(dtype)
    with torch.inference_mode():
        for rows in sorted({*range(1, ONE_PASS_ROWS + 2), packed.dense_rows, packed.dense_rows + 1} - {0}):
            actual = packed(x[:rows])
            widened = packed.widened(x[:rows])
            assert widened.dtype == torch.float32 and torch.equal(widened, actual.float())
            if rows <= packed.dense_rows:
                assert torch.equal(actual, dense_linear(x[:rows], linear.weight, linear.bias))
                if not on_tiles(cpu_kernels.library(), dtype, rows, 96):  # (there from 5 rows on)
                    assert torch.equal(actual[-1:], packed(x[rows - 1 : rows]))
            else:
                onednn = torch.ops.mkldnn._linear_pointwise(
                    x[:rows], packed.packed_weight, packed.bias, "none", [], ""
                )
                assert torch.equal(actual, onednn)
            # A view that is not contiguous takes oneDNN's path, with the same result within rounding.
            strided = x[:rows].t().contiguous().t()
            torch.testing.assert_close(packed(strided), actual, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_no_c_product_where_the_kernels_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    linear = nn.Linear(16, 8)
    assert dense_rows(linear.weight, linear.bias) == 0
    packed = PrepackedLinear(linear, batch_size_hint=4)
    x = torch.randn(1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
