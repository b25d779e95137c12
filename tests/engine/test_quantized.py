"""Weights kept quantized (engine/cpu/quantized.py, quant_kernels.c, gguf/repack.py):

- repacked GGUF blocks hold exactly the values engine/gguf/dequant.py dequantizes them to;
- the kernel's product equals the dequantized float product within float32 summation noise, for every
  layout, for the native build and each portable build (plain C, AVX2, AVX-512 without BF16) this CPU runs;
- float16 block scales (GGUF's own) are what the layout stores, and give bit for bit the products of the
  same scales stored as float32, in every build;
- a GGUF Q8_0 file loads kept quantized (no float copy of its projections) and generates the same greedy
  tokens as the same file dequantized at load; `--quantization int8` does the same for a float folder.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from engine.attention.test_cpu_paged import any_library  # noqa: F401 (a fixture)
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from inflight import sizing
from inflight.engine import runner
from inflight.engine.attention.metadata import SHORT_QUERY_LEN
from inflight.engine.config import EngineConfig
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu import quantized
from inflight.engine.cpu.linear import PrepackedLinear, can_prepack, prepack_linears
from inflight.engine.cpu.quant_layout import Layout
from inflight.engine.cpu.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedTensor,
    lookup_rows,
    quantized_linear,
)
from inflight.engine.engine import LLMEngine
from inflight.engine.gguf.dequant import dequantize
from inflight.engine.gguf.repack import from_gguf_blocks, quantize
from inflight.engine.loader import _quantized_formats, load_model
from inflight.engine.model.errors import ModelLoadError
from inflight.engine.quantization import CPU_LAYOUTS, LOAD_TIME_FORMATS, QUANTIZED_WEIGHT_BYTES
from inflight.engine.sequence import SamplingParams

from support.gguf_files import write_gguf
from support.models import cached_model

FORMATS = ["int8", "q8_0", "q4_0", "q4_1"]
# Float32 products of up to 1536 terms in another order: relative to the output's scale.
RTOL = 1e-5


def _random_q4_k(rows: int, cols: int, gen: torch.Generator) -> np.ndarray:
    """Random Q4_K blocks (the gguf package cannot quantize to Q4_K): random nibbles and 6-bit scales,
    small float16 super-block scales."""
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    blocks = torch.randint(
        0, 256, (rows * cols // block_values, block_bytes), dtype=torch.uint8, generator=gen
    )
    scales = (torch.rand(blocks.shape[0], 2, generator=gen) * 0.01).to(torch.float16)
    blocks[:, :4] = scales.view(torch.uint8)
    return blocks.numpy()


def _blocks(qtype: GGMLQuantizationType, weight: torch.Tensor, gen: torch.Generator) -> np.ndarray:
    if qtype == GGMLQuantizationType.Q4_K:
        return _random_q4_k(*weight.shape, gen)
    return gguf_quants.quantize(weight.numpy(), qtype)


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
    ],
)
def test_repacked_blocks_hold_the_dequantized_values_exactly(qtype: GGMLQuantizationType) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 512, generator=gen)
    raw = _blocks(qtype, weight, gen)
    expected = dequantize(raw, int(qtype), (48, 512), torch.float32)
    repacked = from_gguf_blocks(raw, qtype, (48, 512))
    assert torch.equal(repacked.dequantize(), expected)
    assert torch.equal(repacked[5:9].dequantize(), expected[5:9])


# Bytes a product reads per weight: GGUF's own bytes for Q8_0, Q4_0 and Q4_1 (float16 scales); Q4_K's
# 32-value blocks with float32 scales and offsets (its super-blocks are 0.5625); int8 like Q8_0.
BYTES_PER_WEIGHT = {
    GGMLQuantizationType.Q8_0: 34 / 32,
    GGMLQuantizationType.Q4_0: 20 / 32,
    GGMLQuantizationType.Q4_1: 20 / 32,
    GGMLQuantizationType.Q4_K: 24 / 32,
}


@pytest.mark.parametrize("qtype", list(BYTES_PER_WEIGHT))
def test_the_layout_reads_the_files_float16_scales(qtype: GGMLQuantizationType) -> None:
    """Per weight, the repacked matrix holds (and the kernels read) GGUF's float16 scales, not float32
    ones: 1.0625 bytes for Q8_0 (1.125 with float32 scales), 0.625 for Q4_1 (0.75)."""
    gen = torch.Generator().manual_seed(6)
    raw = _blocks(qtype, torch.randn(64, 512, generator=gen), gen)
    weight = from_gguf_blocks(raw, qtype, (64, 512))
    wanted = BYTES_PER_WEIGHT[qtype]
    assert weight.nbytes == wanted * 64 * 512
    assert weight.layout.bytes_per_weight == wanted
    if qtype != GGMLQuantizationType.Q4_K:
        assert weight.scale_dtype == torch.float16
        assert weight.nbytes == raw.nbytes + (64 * 512 // 32 * 2 if qtype == GGMLQuantizationType.Q4_0 else 0)
    assert weight.interleave_().nbytes == wanted * 64 * 512  # 64 rows: no padding group
    assert quantize(torch.randn(64, 512, generator=gen), "int8").nbytes == 34 / 32 * 64 * 512


@pytest.mark.parametrize("quantization", list(CPU_LAYOUTS))
def test_sizing_plans_the_bytes_a_matrix_is_held_in(quantization: str) -> None:
    """The bytes per weight sizing plans (QUANTIZED_WEIGHT_BYTES: `inflight size`, the operator) are the
    bytes the engine's own packing holds, row-major and interleaved for the kernels: the load-time
    quantizer's for int8 / q8_0 / q4_0 / q4_1, a GGUF file's Q4_K tensor repacked for q4_k."""
    gen = torch.Generator().manual_seed(12)
    rows, cols = 64, 512
    if quantization == "q4_k":
        weight = from_gguf_blocks(_random_q4_k(rows, cols, gen), GGMLQuantizationType.Q4_K, (rows, cols))
    else:
        weight = quantize(torch.randn(rows, cols, generator=gen), quantization)
    assert weight.layout == CPU_LAYOUTS[quantization]
    planned = QUANTIZED_WEIGHT_BYTES[quantization]
    assert planned is not None
    assert weight.nbytes == planned * rows * cols
    assert weight.interleave_().nbytes == planned * rows * cols  # 64 rows: no padding group


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["none", *LOAD_TIME_FORMATS])
def test_sizing_plans_the_weight_bytes_a_loaded_model_holds(arch: str, quantization: str) -> None:
    """sizing.weight_bytes_per_gpu of a model's shape is, byte for byte, what the loaded model holds: its
    quantized matrices (the linear layers, the embedding and the LM head) in their layout's bytes, the
    norms and Qwen2's q/k/v biases in the dtype."""
    model = load_model(cached_model("tiny", arch), quantization=quantization)
    held = sum(t.nbytes for t in model.weight_tensors().values())
    planned = sizing.weight_bytes_per_gpu(
        sizing.shape_of_config("tiny", model.config), model.config.torch_dtype, 1, quantization
    )
    assert planned == held
    if quantization != "none":
        assert isinstance(model.embed_tokens, QuantizedEmbedding)


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["none", *LOAD_TIME_FORMATS])
def test_sizing_plans_the_packed_copy_a_cpu_engine_keeps(arch: str, quantization: str) -> None:
    """On CPU a float32 engine also packs every float matrix among the linear layers and the (tied) LM head
    for oneDNN: sizing.packed_weight_bytes is, byte for byte, what the packed copies hold (tiny's matrices
    need no padding in oneDNN's blocks), none for the matrices a format quantized."""
    model = load_model(cached_model("tiny", arch), quantization=quantization)
    assert model.config.torch_dtype == "float32"
    packed_count = prepack_linears(model, batch_size_hint=8)
    packed = [m.packed_weight for m in model.modules() if isinstance(m, PrepackedLinear)]
    assert len(packed) == packed_count
    held = sum(torch.ops.mkldnn._nbytes(weight) for weight in packed)
    assert (
        sizing.packed_weight_bytes(sizing.shape_of_config("tiny", model.config), "float32", quantization)
        == held
    )
    assert (held > 0) == (quantization == "none")


def _float32_scales(weight: QuantizedTensor) -> QuantizedTensor:
    """The same matrix with its scales (and offsets) stored as float32."""
    mins = None if weight.mins is None else weight.mins.float()
    return QuantizedTensor(weight.format, weight.qweight.clone(), weight.scales.float(), mins)


@pytest.mark.parametrize("fmt", FORMATS)
def test_float16_scales_give_the_products_of_the_same_float32_scales(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
) -> None:
    """Bit for bit, in every build (the portable one widens float16 in C): the fused product for 1, 5
    and 64 one-token rows, the float one for 12 prompt rows (panels or dequantized rows), and row
    lookups. Rows 0-19 are small (|w| ~ 1e-4), so their scales are float16 subnormals; Q4_1's offsets
    are negative."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: any_library)
    gen = torch.Generator().manual_seed(7)
    source = torch.randn(83, 160, generator=gen)
    source[:20] *= 1e-4
    weight = quantize(source, fmt)
    assert weight.scale_dtype == torch.float16
    assert (weight.scales[:20].abs() < torch.finfo(torch.float16).tiny).all()
    wide = _float32_scales(weight)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, one_token in ((1, True), (5, True), (64, True), (12, False)):
            x = torch.randn(rows, 160, generator=gen).to(dtype)
            with quantized.one_token_rows(one_token):
                assert torch.equal(quantized_linear(x, weight), quantized_linear(x, wide))
        ids = torch.tensor([0, 19, 20, 82, 5])
        assert torch.equal(lookup_rows(weight, ids, dtype), lookup_rows(wide, ids, dtype))


def test_float16_scales_take_only_values_float16_holds() -> None:
    """Loading rows into a float16-scale matrix refuses scales float16 would round (Q4_K's), a float32 one
    takes any."""
    gen = torch.Generator().manual_seed(8)
    q4_k = from_gguf_blocks(_random_q4_k(16, 256, gen), GGMLQuantizationType.Q4_K, (16, 256))
    with pytest.raises(ValueError, match="not exactly"):
        QuantizedTensor.empty(Layout("u4", "float16"), 16, 256).copy_(q4_k)
    q4_0 = quantize(torch.randn(16, 256, generator=gen), "q4_0")
    for source in (q4_k, q4_0):
        wide = QuantizedTensor.empty(Layout("u4", "float32"), 16, 256).copy_(source)
        assert torch.equal(wide.dequantize(), source.dequantize())


def test_a_fused_projection_of_mixed_gguf_types_keeps_float32_scales_where_a_part_needs_them(
    tiny_llama_dir: Path,
) -> None:
    """q/k/v in one matrix: Q4_0 and Q4_K parts share u4 with float32 scales, Q4_0 and Q4_1 parts u4 with
    float16 ones; a Q8_0 part beside a Q4_1 one (two formats) is not kept."""
    model = load_model(tiny_llama_dir)
    types = {name: GGMLQuantizationType.Q4_0 for name in model.weight_targets()}

    class Checkpoint:
        def tensor_types(self) -> dict[str, GGMLQuantizationType]:
            return types

    def layouts() -> dict[str, Layout]:
        return _quantized_formats(model, "auto", Checkpoint())  # type: ignore[arg-type]

    attention = "model.layers.0.self_attn"
    qkv, mlp = "layers.0.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj"
    assert layouts()[qkv] == Layout("u4", "float16")
    types[f"{attention}.k_proj.weight"] = GGMLQuantizationType.Q4_K
    types[f"{attention}.v_proj.weight"] = GGMLQuantizationType.Q4_1
    types["model.layers.0.mlp.up_proj.weight"] = GGMLQuantizationType.Q8_0
    assert layouts()[qkv] == Layout("u4", "float32")
    assert mlp not in layouts()
    types[f"{attention}.k_proj.weight"] = GGMLQuantizationType.Q4_1
    assert layouts()[qkv] == Layout("u4", "float16")


def test_int8_has_one_scale_per_output_channel() -> None:
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    weight[3] *= 100
    q = quantize(weight, "int8")
    assert q.format == "s8"
    assert torch.equal(q.scales, q.scales[:, :1].expand_as(q.scales))
    # The float16 nearest absmax / 127 from above: no value clipped, the step 2^-10 wider at most.
    scale, exact = q.scales[:, 0], weight.abs().amax(1) / 127
    below = torch.nextafter(scale, scale.new_tensor(0.0))
    assert scale.dtype == torch.float16 and (scale.float() >= exact).all() and (below.float() < exact).all()
    assert (q.dequantize() - weight).abs().max(1).values.le(scale.float() / 2 + 1e-6).all()


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the AVX-512 VNNI kernel multiplies it: per row and block of 32, int8 values x max |x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_max_rows", [64, quantized.KERNEL_MAX_ROWS])
def test_the_product_equals_the_dequantized_product(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    dtype: torch.dtype,
    kernel_max_rows: int,
) -> None:
    """Through the fused kernel for every row count (64), and as the engine runs it (the kernel up to
    KERNEL_MAX_ROWS rows, the dequantized float product above). The fused kernel's reference has x in
    int8 blocks where the build multiplies int8 (AVX-512 VNNI), float x elsewhere."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: any_library)
    monkeypatch.setattr(quantized, "KERNEL_MAX_ROWS", kernel_max_rows)
    monkeypatch.setattr(quantized, "DEQUANTIZE_CHUNK_ROWS", 32)  # several chunks
    gen = torch.Generator().manual_seed(3)
    weight = quantize(torch.randn(83, 160, generator=gen), fmt)  # 83: a partial tile of output rows
    bias = torch.randn(83, generator=gen).to(dtype)
    int8_activations = bool(any_library.quant_linear_int8_activations())
    for rows in (1, 3, 4, 17):  # partial and whole 4-row tiles
        x = torch.randn(rows, 160, generator=gen).to(dtype)
        fused = rows <= kernel_max_rows
        xq = _int8_blocks(x.float()) if fused and int8_activations else x.float()
        expected = (xq @ weight.dequantize().T + bias.float()).to(dtype)
        got = quantized_linear(x, weight, bias)
        assert got.dtype == dtype and got.shape == (rows, 83)
        scale = expected.float().abs().max().item()
        # An x exactly half-way between two int8 steps (common in bfloat16) may round the other way in
        # the kernel than in torch: one step of x times a weight, allowed for up to 4 such x.
        ties = 4 * x.float().abs().max().item() / 127 * weight.dequantize().abs().max().item()
        atol = RTOL * scale + (ties if fused and int8_activations else 0.0)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=0, atol=atol)
        elif fused:  # one bfloat16 rounding of the output apart at most
            torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=atol)
        else:  # and the weights rounded to bfloat16 for the float product
            torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2**-7 * scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_gives_the_same_bits_on_one_thread_and_on_two(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    dtype: torch.dtype,
) -> None:
    """A batch-1 decode projection is split over the threads (163 x 1024: 11 groups of 16 rows, the last
    partial; enough work for two threads at one row): each output is the same bits on one thread and on
    two, for 1, 3 and 17 rows of x, in every build."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: any_library)
    monkeypatch.setattr(quantized, "KERNEL_MAX_ROWS", 64)  # the kernel at every row count here
    gen = torch.Generator().manual_seed(7)
    weight = quantize(torch.randn(163, 1024, generator=gen), fmt)
    bias = torch.randn(163, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        for rows in (1, 3, 17):
            x = torch.randn(rows, 1024, generator=gen).to(dtype)
            torch.set_num_threads(1)
            one = quantized_linear(x, weight, bias)
            torch.set_num_threads(2)
            two = quantized_linear(x, weight, bias)
            assert torch.equal(one, two), f"{rows} rows"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_interleaving_keeps_the_matrix_and_refuses_row_changes(fmt: str) -> None:
    """The kernels' layout (groups of 16 rows, 83 rows: a partial group) holds the same matrix, and
    loading-time row operations are refused once a matrix is in it."""
    weight = quantize(torch.randn(83, 96, generator=torch.Generator().manual_seed(5)), fmt)
    before = weight.dequantize()
    row_major = QuantizedTensor(weight.format, weight.qweight, weight.scales, weight.mins)
    assert weight.interleave_() is weight and weight.shape == (83, 96)
    assert weight.qweight.shape[0] == 6  # 83 rows in 6 groups of 16
    assert torch.equal(weight.dequantize(), before)
    back = weight.row_major()
    assert torch.equal(back.qweight, row_major.qweight) and torch.equal(back.scales, row_major.scales)
    with pytest.raises(ValueError, match="interleaved"):
        weight[0:16]
    with pytest.raises(ValueError, match="interleaved"):
        weight.copy_(row_major)


def test_the_kernels_are_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The products above are the C kernels', not the PyTorch fallback's: the fused one for a few rows;
    for more, float32 rows (and up to BFLOAT16_PANEL_MAX_ROWS bfloat16 rows) by the panel product where
    the build has it, more bfloat16 rows (and every count elsewhere) by dequantized rows."""
    weight = quantize(torch.randn(16, 64), "q4_1")
    calls: list[str] = []
    library = cpu_kernels.library()
    assert library is not None

    class Spy:
        def __getattr__(self, name: str) -> object:
            calls.append(name)
            return getattr(library, name)

    monkeypatch.setattr(cpu_kernels, "library", lambda: Spy())
    quantized_linear(torch.randn(quantized.KERNEL_MAX_ROWS, 64), weight)
    assert calls == ["quant_linear"]
    panels = bool(library.quant_linear_float_built())
    calls.clear()
    quantized_linear(torch.randn(quantized.KERNEL_MAX_ROWS + 1, 64), weight)
    assert calls[-1] == ("quant_linear_float" if panels else "quant_rows")
    calls.clear()
    quantized_linear(torch.randn(quantized.KERNEL_MAX_ROWS + 1, 64).bfloat16(), weight)
    assert calls[-1] == ("quant_linear_float" if panels else "quant_rows")
    calls.clear()
    quantized_linear(torch.randn(quantized.BFLOAT16_PANEL_MAX_ROWS + 1, 64).bfloat16(), weight)
    assert calls[-1] == "quant_rows" and "quant_linear_float" not in calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_rows_are_multiplied_by_the_dequantized_weights_panel_by_panel(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
) -> None:
    """More than KERNEL_MAX_ROWS float32 rows: within RTOL of x times the dequantized matrix (float64
    sums) and never through a whole dequantized matrix where the build has the panel product; for panels
    of 48 outputs with a partial group (100 rows: 7 groups, the last panel one group; 20 rows: a panel
    with one group missing), 160 inputs (a chunk of 4 blocks and one of 1), tiles of 8 rows and a
    remainder, and more rows than one pass over a panel takes (300 > 256); the panel product gives the
    same bits on one thread and on two (PyTorch's product of the dequantized chunks, on builds without
    it, need not: MKL's on AMD Zen 4 does not). bfloat16 rows up to BFLOAT16_PANEL_MAX_ROWS: the float32
    product of the widened rows, rounded to bfloat16 once (float32 logits unrounded)."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: any_library)
    panels = bool(any_library.quant_linear_float_built())
    if panels:
        monkeypatch.setattr(quantized, "dequantize_rows", None)  # any call would fail
    gen = torch.Generator().manual_seed(12)
    before = torch.get_num_threads()
    try:
        for n in (100, 20):
            weight = quantize(torch.randn(n, 160, generator=gen), fmt)
            dense = weight.dequantize().double()
            for rows, with_bias in ((9, True), (17, False), (300, True)):
                x = torch.randn(rows, 160, generator=gen)
                bias = torch.randn(n, generator=gen) if with_bias else None
                torch.set_num_threads(2)
                got = quantized_linear(x, weight, bias)
                torch.set_num_threads(1)
                alone = quantized_linear(x, weight, bias)
                if panels:
                    assert torch.equal(alone, got), f"{n} x {rows}"
                expected = x.double() @ dense.T + (0.0 if bias is None else bias.double())
                assert got.dtype == torch.float32 and got.shape == (rows, n)
                atol = RTOL * expected.abs().max().item()
                torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol)
                torch.testing.assert_close(alone.double(), expected, rtol=0, atol=atol)
                if panels and rows <= quantized.BFLOAT16_PANEL_MAX_ROWS:
                    xb, bb = x.bfloat16(), None if bias is None else bias.bfloat16()
                    wide = quantized_linear(xb.float(), weight, None if bb is None else bb.float())
                    assert torch.equal(quantized_linear(xb, weight, bb), wide.bfloat16())
                    assert torch.equal(quantized_linear(xb, weight, bb, out_dtype=torch.float32), wide)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_rows_take_the_kernel_at_any_count_each_row_as_if_alone(
    fmt: str, dtype: torch.dtype
) -> None:
    """A decode-only step's rows (`one_token_rows`): where the kernel rounds x to int8, 40 rows go through
    it and each row's output is bit for bit its output alone (a token's logits do not depend on its batch);
    the same 40 rows as prompt rows take the dequantized float product, which rounds x differently."""
    library = cpu_kernels.library()
    assert library is not None
    gen = torch.Generator().manual_seed(11)
    weight = quantize(torch.randn(83, 160, generator=gen), fmt)
    x = torch.randn(40, 160, generator=gen).to(dtype)
    with quantized.one_token_rows():
        together = quantized_linear(x, weight)
        alone = torch.cat([quantized_linear(x[i : i + 1], weight) for i in range(40)])
    as_prompt = quantized_linear(x, weight)
    if not library.quant_linear_int8_activations():
        pytest.skip("this CPU's kernel multiplies float x: it keeps the 8-row switch for every row")
    assert torch.equal(together, alone)
    assert not torch.equal(as_prompt, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_embedding_looks_up_dequantized_rows(
    any_library: ctypes.CDLL,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
) -> None:
    monkeypatch.setattr(cpu_kernels, "library", lambda: any_library)
    weight = quantize(torch.randn(50, 96, generator=torch.Generator().manual_seed(4)), "q4_0")
    embedding = QuantizedEmbedding(50, 96, weight.layout, dtype)
    embedding.weight.copy_(weight)
    ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
    assert torch.equal(embedding(ids), weight.dequantize(dtype)[ids])
    # A whole matrix large enough for two threads (1100 x 512: quant_rows takes 256 K values a thread).
    large = quantize(torch.randn(1100, 512, generator=torch.Generator().manual_seed(5)), "q4_1")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(quantized.dequantize_rows(large, 0, 1100, dtype), large.dequantize(dtype))
    finally:
        torch.set_num_threads(before)


def test_a_q8_0_gguf_stays_quantized_and_generates_the_dequantized_tokens(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    gguf = write_gguf(tiny_llama_dir, tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0, tokenizer=True)
    kept = load_model(gguf)
    projections = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    assert len(projections) == 4 * kept.config.num_hidden_layers + 1  # + the (untied) LM head
    assert isinstance(kept.embed_tokens, QuantizedEmbedding)
    assert not any(p.numel() >= 128 * 128 for p in kept.parameters())  # no float copy of a matrix
    file_size = gguf.stat().st_size
    weight_bytes = sum(t.nbytes for t in kept.weight_tensors().values())
    assert weight_bytes <= 1.25 * file_size
    assert not any(isinstance(m, QuantizedLinear) for m in load_model(gguf, quantization="none").modules())

    prompts = [[5, 77, 300, 12, 901, 4, 64], [9, 8, 7, 6, 5], list(range(40, 70))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(quantization: str, dtype: str) -> list[list[int]]:
        config = EngineConfig(dtype=dtype, device="cpu", num_kv_blocks=32, quantization=quantization)
        engine = LLMEngine(gguf, config)
        try:
            return [output.outputs[0].token_ids for output in engine.generate(prompts, params)]
        finally:
            engine.close()

    assert run("auto", "float32") == run("none", "float32")


def test_decode_steps_of_many_sequences_multiply_by_the_kernel_not_by_dequantized_weights(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 sequences decoding together: their decode-only steps (12 rows, above KERNEL_MAX_ROWS) run the
    quantized kernel where it rounds x to int8, and only the prompt step (prompts longer than
    SHORT_QUERY_LEN: a verify step's few rows a sequence would take the kernel too) multiplies by the
    dequantized weights (float32: panel by panel where the build has that product)."""
    library = cpu_kernels.library()
    assert library is not None
    if not library.quant_linear_int8_activations():
        pytest.skip("this CPU's kernel multiplies float x: every step above 8 rows dequantizes")
    gguf = write_gguf(tiny_llama_dir, tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0, tokenizer=True)
    dequantized_in: list[bool] = []
    in_step: list[bool] = []
    dequantize_rows, panel_product = quantized.dequantize_rows, quantized._panel_product
    original_run_model = runner.run_model

    def counting_dequantize(*args: object, **kwargs: object) -> torch.Tensor:
        dequantized_in[-1] = True
        return dequantize_rows(*args, **kwargs)  # type: ignore[arg-type]

    def counting_panels(*args: object, **kwargs: object) -> torch.Tensor:
        dequantized_in[-1] = True
        return panel_product(*args, **kwargs)  # type: ignore[arg-type]

    def watched_run_model(*args: object, **kwargs: object) -> torch.Tensor | None:
        inputs = args[2]
        assert isinstance(inputs, runner.StepInputs)
        in_step.append(max(inputs.query_lens, default=0) == 1)
        dequantized_in.append(False)
        return original_run_model(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quantized, "dequantize_rows", counting_dequantize)
    monkeypatch.setattr(quantized, "_panel_product", counting_panels)
    monkeypatch.setattr(runner, "run_model", watched_run_model)
    engine = LLMEngine(gguf, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64))
    try:
        prompts = [[5 + i] + [77 + 13 * j for j in range(SHORT_QUERY_LEN)] for i in range(12)]
        engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        engine.close()
    decode_steps = [dq for decode, dq in zip(in_step, dequantized_in, strict=True) if decode]
    prompt_steps = [dq for decode, dq in zip(in_step, dequantized_in, strict=True) if not decode]
    assert len(decode_steps) >= 5 and not any(decode_steps)
    assert prompt_steps and all(prompt_steps)


def test_int8_at_load_quantizes_a_float_folder(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, quantization="int8")
    reference = load_model(tiny_llama_dir)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and isinstance(qkv.weight, QuantizedTensor)
    expected = quantize(reference.layers[0].self_attn.qkv_proj.weight.detach(), "int8")
    assert torch.equal(qkv.weight.dequantize(), expected.dequantize())


def test_quantization_at_load_is_refused_where_it_cannot_run(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="tensor-parallel-size 1"):
        load_model(tiny_llama_dir, quantization="int8", world_size=2)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(tiny_llama_dir, quantization="q4_k")  # Q4_K is read from a GGUF file, never made
