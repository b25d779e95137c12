"""Weights kept quantized in memory on CPU: 32-value blocks multiplied by quant_kernels.c.

Two kernel layouts hold every supported format (see quant_kernels.c and quant_layout.py): `s8` (signed
bytes and a scale per block: GGUF Q8_0, and int8 per output channel with the channel's scale in every
block) and `u4` (nibbles, a scale and an offset per block: GGUF Q4_0, Q4_1 and Q4_K, whose 8 sub-blocks
of 32 each have their own scale and minimum). Scales and offsets are float16 where float16 holds them
(GGUF Q8_0, Q4_0 and Q4_1 store theirs as float16; int8's are chosen in float16), else float32 (Q4_K's,
products of two scales): Q8_0 reads 1.0625 bytes a weight, as in the file, instead of 1.125 with float32
scales (docs/models.md). GGUF blocks are repacked into them once at load
(engine/gguf/repack.py), row by row; before its first product or lookup by the kernels a matrix is
interleaved in place by groups of 16 rows (`interleave_`, the layout quant_kernels.c reads: one vector
load holds 4 bytes of each of 16 rows, so a block of 16 rows is 8 int8 dot-product instructions and one
multiply-add by its 16 scales).

`QuantizedLinear` and `QuantizedEmbedding` replace nn.Linear / nn.Embedding; their `weight` is a
`QuantizedTensor` the loader fills row by row like a float parameter. Without the C kernels (no compiler)
they dequantize the weight for each call and run the PyTorch product: same values, slower.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.quant_layout import (
    BLOCK,
    BLOCK_BYTES,
    GROUP,
    S8_OFFSET,
    KernelFormat,
    Layout,
    ScaleDtype,
    whole_blocks,
)

# The torch dtype of each scale dtype a layout names, and back.
SCALE_DTYPES: dict[ScaleDtype, torch.dtype] = {"float16": torch.float16, "float32": torch.float32}
SCALE_DTYPE_NAMES: dict[torch.dtype, ScaleDtype] = {dtype: name for name, dtype in SCALE_DTYPES.items()}


@dataclass
class QuantizedTensor:
    """A [rows, cols] matrix in one kernel format (cols a multiple of 32): per row, cols / 32 blocks.

    Row-major as loaded; interleaved for the kernels by `interleave_` (then `interleaved_rows` is the
    row count, qweight [groups, blocks, 16 * BLOCK_BYTES[format]] and scales / mins [groups, blocks, 16]
    for groups = rows / 16 rounded up; see quant_kernels.c). Scales and mins share one dtype, float16 or
    float32 (`scale_dtype`)."""

    format: KernelFormat
    qweight: torch.Tensor  # uint8 [rows, cols / 32 * BLOCK_BYTES[format]]
    scales: torch.Tensor  # float16 or float32 [rows, cols / 32]
    mins: torch.Tensor | None  # [rows, cols / 32], the scales' dtype, for u4; None for s8
    interleaved_rows: int | None = None

    def __post_init__(self) -> None:
        if self.scales.dtype not in SCALE_DTYPE_NAMES:
            raise ValueError(f"quantized scales are float16 or float32, not {self.scales.dtype}")
        if self.mins is not None and self.mins.dtype != self.scales.dtype:
            raise ValueError(f"mins ({self.mins.dtype}) and scales ({self.scales.dtype}) differ in dtype")

    @classmethod
    def empty(cls, layout: Layout, rows: int, cols: int) -> QuantizedTensor:
        if not whole_blocks(cols):
            raise ValueError(f"a quantized matrix needs a multiple of {BLOCK} columns, got {cols}")
        blocks, scale_dtype = cols // BLOCK, SCALE_DTYPES[layout.scale_dtype]
        return cls(
            layout.format,
            torch.empty(rows, blocks * BLOCK_BYTES[layout.format], dtype=torch.uint8),
            torch.empty(rows, blocks, dtype=scale_dtype),
            torch.empty(rows, blocks, dtype=scale_dtype) if layout.format == "u4" else None,
        )

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def layout(self) -> Layout:
        return Layout(self.format, SCALE_DTYPE_NAMES[self.scale_dtype])

    @property
    def kernel_code(self) -> int:
        """The `format` argument of the C kernels for this matrix (quant_layout.Layout.kernel_code)."""
        return self.layout.kernel_code

    @property
    def shape(self) -> tuple[int, int]:
        if self.interleaved_rows is not None:
            return self.interleaved_rows, self.scales.shape[1] * BLOCK
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def __getitem__(self, key: slice | torch.Tensor | tuple[slice, ...]) -> QuantizedTensor:
        """Rows `key` (a slice: a view, like a tensor's; an index tensor: a copy), or (rows, all columns):
        blocks run along the columns, so a part of them is refused."""
        self._check_row_major("taking rows")
        rows = key[0] if isinstance(key, tuple) else key
        if isinstance(key, tuple) and len(key) > 1:
            cols = self.shape[1]
            if key[1].indices(cols) != (0, cols, 1):
                raise ValueError("a quantized matrix cannot be split by columns (tensor parallel row split)")
        return QuantizedTensor(
            self.format, self.qweight[rows], self.scales[rows], None if self.mins is None else self.mins[rows]
        )

    def copy_(self, source: QuantizedTensor) -> QuantizedTensor:
        """Fill these rows from quantized rows of the same layout and shape; float16 scales take float32
        ones only where float16 holds them exactly."""
        self._check_row_major("copying rows in")
        source = source.row_major()
        if source.format != self.format or source.shape != self.shape:
            raise ValueError(
                f"cannot copy a {source.format} {source.shape} matrix into {self.format} {self.shape}"
            )
        for t in (source.scales, source.mins):
            if t is not None and not torch.equal(t.to(self.scale_dtype).to(t.dtype), t):
                raise ValueError(f"cannot store these {t.dtype} scales as {self.scale_dtype}: not exactly")
        self.qweight.copy_(source.qweight)
        self.scales.copy_(source.scales)
        if self.mins is not None and source.mins is not None:
            self.mins.copy_(source.mins)
        return self

    def zero_(self) -> QuantizedTensor:
        self._check_row_major("zeroing rows")
        self.qweight.zero_()
        self.scales.zero_()
        if self.mins is not None:
            self.mins.zero_()
        return self

    def permute_rows(self, order: torch.Tensor) -> QuantizedTensor:
        self._check_row_major("permuting rows")
        return QuantizedTensor(
            self.format,
            self.qweight[order],
            self.scales[order],
            None if self.mins is None else self.mins[order],
        )

    def _check_row_major(self, what: str) -> None:
        if self.interleaved_rows is not None:
            raise ValueError(f"{what} of a quantized matrix the kernels have interleaved (load it first)")

    def interleave_(self) -> QuantizedTensor:
        """Put the data into the kernels' interleaved layout, in place (once; the same bytes, permuted,
        plus zero rows up to a multiple of 16). Row operations (loading) are refused afterwards."""
        if self.interleaved_rows is not None:
            return self
        rows, cols = self.shape
        blocks, block_bytes = cols // BLOCK, BLOCK_BYTES[self.format]
        groups = -(-rows // GROUP)
        pad = groups * GROUP - rows

        def grouped(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(pad, t.shape[1])]).reshape(groups, GROUP, *t.shape[1:])

        q = grouped(self.qweight)
        if self.format == "s8":
            q = q ^ S8_OFFSET
        # [groups, 16 rows, blocks, chunks of 4 bytes, 4] -> [groups, blocks, chunks, 16 rows, 4]
        q = q.reshape(groups, GROUP, blocks, block_bytes // 4, 4).permute(0, 2, 3, 1, 4)
        self.qweight = q.reshape(groups, blocks, GROUP * block_bytes).contiguous()
        self.scales = grouped(self.scales).transpose(1, 2).contiguous()
        if self.mins is not None:
            self.mins = grouped(self.mins).transpose(1, 2).contiguous()
        self.interleaved_rows = rows
        return self

    def row_major(self) -> QuantizedTensor:
        """This matrix in the row-major layout (itself when it is; else a copy)."""
        rows = self.interleaved_rows
        if rows is None:
            return self
        groups, blocks, _ = self.qweight.shape
        block_bytes = BLOCK_BYTES[self.format]
        q = self.qweight.reshape(groups, blocks, block_bytes // 4, GROUP, 4).permute(0, 3, 1, 2, 4)
        q = q.reshape(groups * GROUP, blocks * block_bytes)[:rows]
        if self.format == "s8":
            q = q ^ S8_OFFSET

        def rows_of(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(groups * GROUP, blocks)[:rows].contiguous()

        return QuantizedTensor(
            self.format,
            q.contiguous(),
            rows_of(self.scales),
            None if self.mins is None else rows_of(self.mins),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix: the definition of what the kernel multiplies by."""
        if self.interleaved_rows is not None:
            return self.row_major().dequantize(dtype)
        rows, cols = self.shape
        blocks = self.qweight.reshape(rows, cols // BLOCK, BLOCK_BYTES[self.format])
        scales = self.scales.float()[..., None]
        if self.format == "s8":
            values = scales * blocks.view(torch.int8).float()
        else:
            assert self.mins is not None
            q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).float()
            values = scales * q + self.mins.float()[..., None]
        return values.reshape(rows, cols).to(dtype)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """int8 weight-only, one symmetric scale per output row, stored in s8 blocks: the float16 nearest
    absmax / 127 from above (so no value is clipped), the values rounded to it (docs/models.md: float16
    scales, measured against float32 ones)."""
    rows, cols = weight.shape
    w = weight.detach().float()
    exact = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = exact.half()
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, scale.new_tensor(torch.inf)), scale)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if not scale.isfinite().all():
        raise ValueError("int8 quantization: a row's largest weight is beyond float16 scales (|w| > 8e6)")
    q = torch.clamp(torch.round(w / scale.float()), -127, 127).to(torch.int8)
    blocks = cols // BLOCK
    if not whole_blocks(cols):
        raise ValueError(f"int8 quantization needs a multiple of {BLOCK} input features, got {cols}")
    return QuantizedTensor(
        "s8", q.view(torch.uint8).contiguous(), scale.expand(rows, blocks).contiguous(), None
    )


# Rows of x up to which the fused kernel runs in a step with prompt rows; above, prompt rows are multiplied
# by the float weights, not rounded to int8 (docs/models.md): float32 x (and a few bfloat16 rows,
# widened) by the C kernel that dequantizes the weights panel by panel in cache (AVX-512 and AVX2
# builds), else each weight dequantized (by the C kernel, into the activations' dtype) and multiplied by
# oneDNN/MKL.
# Rows that are each one sequence's single new token (`one_token_rows`) take the kernel at any count
# where it rounds x to int8: a token's logits then do not depend on how many others share its step, and
# the kernel is 2-5x faster than dequantizing every weight for every step.
KERNEL_MAX_ROWS = 8
_ONE_TOKEN_ROWS: ContextVar[bool] = ContextVar("one_token_rows", default=False)
# Output rows dequantized at a time above KERNEL_MAX_ROWS: bounds the float copy of a large matrix (an
# LM head of 49152 x 576) to a few MiB.
DEQUANTIZE_CHUNK_ROWS = 8192
# bfloat16 prompt rows up to which the float32 panel product takes them (x widened, exactly; the sums
# rounded to bfloat16 once): a SmolLM2 layer's four Q4_1 products at 16 / 32 rows took 490 / 815 us
# against 909 / 932 for bfloat16 weights dequantized into memory and oneDNN's AMX product, at 48 / 64 rows
# 1179 / 1484 against 1097 / 1156 (Sapphire Rapids, 2 threads; docs/models.md).
BFLOAT16_PANEL_MAX_ROWS = 32


@contextmanager
def one_token_rows(enabled: bool = True) -> Iterator[None]:
    """Within it, `quantized_linear` treats its rows as tokens a decode step at batch 1 would also put
    through the kernel (a decode-only step's layers, the LM head's rows to sample): any count takes it."""
    token = _ONE_TOKEN_ROWS.set(enabled)
    try:
        yield
    finally:
        _ONE_TOKEN_ROWS.reset(token)


def kernel_takes(rows: int, library: ctypes.CDLL) -> bool:
    """Whether `quantized_linear` multiplies `rows` rows of x by the C kernel (else by the dequantized
    weights), here (inside or outside `one_token_rows`)."""
    return rows <= KERNEL_MAX_ROWS or (
        _ONE_TOKEN_ROWS.get() and bool(library.quant_linear_int8_activations())
    )


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedTensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for a quantized W: the C kernel for up to KERNEL_MAX_ROWS rows of x (for any count
    of one-token rows where the kernel rounds x to int8), else the float product: by the panel kernel
    (`_panels_take`), or W dequantized chunk by chunk; without the kernels, the dequantized PyTorch
    product.

    `out_dtype` (default x's): float32 for bfloat16 x gives the kernel's float sums unrounded (the LM
    head's logits); the other paths compute in x's dtype and convert."""
    library = cpu_kernels.library_for(x) if bias is None else cpu_kernels.library_for(x, bias)
    rows_out, cols = weight.shape
    x2 = x.reshape(-1, cols)
    if library is None or not kernel_takes(x2.shape[0], library):
        if library is not None and _panels_take(x2, out_dtype, library):
            out = _panel_product(x2.float(), weight, None if bias is None else bias.float(), library)
            return out.to(out_dtype or x.dtype).reshape(*x.shape[:-1], rows_out)
        parts = [
            F.linear(
                x,
                dequantize_rows(weight, start, min(start + DEQUANTIZE_CHUNK_ROWS, rows_out), x.dtype),
                None if bias is None else bias[start : start + DEQUANTIZE_CHUNK_ROWS],
            )
            for start in range(0, rows_out, DEQUANTIZE_CHUNK_ROWS)
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out if out_dtype is None else out.to(out_dtype)
    x2 = x2.contiguous()
    weight.interleave_()
    out_dtype = out_dtype or x.dtype
    out = torch.empty((x2.shape[0], rows_out), dtype=out_dtype)
    status = library.quant_linear(
        x2.data_ptr(),
        x2.shape[0],
        cols,
        weight.qweight.data_ptr(),
        weight.scales.data_ptr(),
        None if weight.mins is None else weight.mins.data_ptr(),
        weight.kernel_code,
        rows_out,
        None if bias is None else bias.data_ptr(),
        cpu_kernels.DTYPE_CODES[x.dtype],
        out.data_ptr(),
        cpu_kernels.DTYPE_CODES[out_dtype],
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("quant_linear: out of memory for its buffers")
    return out.reshape(*x.shape[:-1], rows_out)


def _panels_take(x2: torch.Tensor, out_dtype: torch.dtype | None, library: ctypes.CDLL) -> bool:
    """Whether prompt rows x2 [rows, cols] go through `quant_linear_float` here (AVX-512 and AVX2
    builds): float32 rows, and up to BFLOAT16_PANEL_MAX_ROWS bfloat16 rows widened to float32."""
    if out_dtype not in (None, x2.dtype, torch.float32) or not library.quant_linear_float_built():
        return False
    return x2.dtype == torch.float32 or (
        x2.dtype == torch.bfloat16 and x2.shape[0] <= BFLOAT16_PANEL_MAX_ROWS
    )


def _panel_product(
    x2: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None, library: ctypes.CDLL
) -> torch.Tensor:
    """x2 [rows, cols] (float32) W^T (+ bias, float32): the weights dequantized panel by panel inside the C
    kernel, never as a whole float matrix."""
    x2 = x2.contiguous()
    bias = None if bias is None else bias.contiguous()
    weight.interleave_()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=torch.float32)
    status = library.quant_linear_float(
        x2.data_ptr(),
        x2.shape[0],
        x2.shape[1],
        weight.qweight.data_ptr(),
        weight.scales.data_ptr(),
        None if weight.mins is None else weight.mins.data_ptr(),
        weight.kernel_code,
        weight.shape[0],
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("quant_linear_float: out of memory for its panel buffers")
    return out


def dequantize_rows(weight: QuantizedTensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start..end of W in `dtype`: by the C kernel where it takes `dtype`, else by PyTorch."""
    return lookup_rows(weight, torch.arange(start, end), dtype)


def lookup_rows(weight: QuantizedTensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (int64, 1-D) of W dequantized into `dtype` (an embedding lookup)."""
    library = cpu_kernels.library() if dtype in cpu_kernels.DTYPE_CODES else None
    if library is None:
        return weight.row_major()[ids].dequantize(dtype)
    ids = ids.contiguous()
    weight.interleave_()
    out = torch.empty(ids.numel(), weight.shape[1], dtype=dtype)
    status = library.quant_rows(
        weight.qweight.data_ptr(),
        weight.scales.data_ptr(),
        None if weight.mins is None else weight.mins.data_ptr(),
        weight.kernel_code,
        weight.shape[1],
        ids.data_ptr(),
        ids.numel(),
        cpu_kernels.DTYPE_CODES[dtype],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("quant_rows: out of memory for its buffers")
    return out


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W a QuantizedTensor (the bias stays a float parameter)."""

    def __init__(self, in_features: int, out_features: int, layout: Layout, bias: nn.Parameter | None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = QuantizedTensor.empty(layout, out_features, in_features)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.weight.format}, scales={self.weight.scale_dtype}, bias={self.bias is not None}"
        )


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized: a lookup dequantizes the rows it returns, into `dtype`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, layout: Layout, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.weight = QuantizedTensor.empty(layout, num_embeddings, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        return lookup_rows(self.weight, flat, self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight.format}, "
            f"scales={self.weight.scale_dtype}"
        )
