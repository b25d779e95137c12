"""Linear layers with oneDNN-prepacked weights, for float32 (and native bfloat16) inference on CPU.

PyTorch's default CPU GEMM (MKL sgemm) runs the engine's small-batch projections at a fraction of the
machine's speed; oneDNN with the weight reordered once into its blocked layout is faster on them
(measurements: docs/benchmarks.md). bfloat16 is prepacked too where the CPU runs it natively
(AVX512-BF16 / AMX, cpu/isa.py): oneDNN's bf16 kernels there are about 2x its float32 ones. The engine
swaps the decoder layers' projections after loading; CUDA and other dtypes are left alone.

At a few rows (a decode step of that many sequences) oneDNN streams the weights well below the
memory's speed, while a step of a small model is nearly all weight reads: there the product runs in
C instead (`dense_linear` in cpu/kernels.c) on the plain weight, which the module keeps anyway; each row's
result is then the same whatever the other rows of the batch. bfloat16 products take up to 16 rows there
with AVX512-BF16 and float32 ones up to 24 with AVX-512 or AVX2 + FMA (more passes over each weight row in
cache; without AVX512-BF16 bfloat16 stays oneDNN's), and on CPUs with AMX-BF16 bfloat16 products of five to
64 rows run in C on the tiles (`dense_rows` says how many rows a weight's products take).
So the float weights are held twice, plain and packed (prompts' longer chunks still multiply in oneDNN):
sizing.packed_weight_bytes plans that copy (the operator's CPU plans).
"""

from __future__ import annotations

import ctypes
import logging
import time

import torch
from torch import nn

from inflight.engine.cpu import huge_pages
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.isa import cpu_isa
from inflight.engine.cpu.quantized import QuantizedTensor
from inflight.engine.dtypes import CPU_PREPACKED_DTYPES

logger = logging.getLogger("inflight.engine")

# oneDNN keeps its GEMM primitives in one process-wide LRU cache of 1024 (its default capacity). The
# batch sizes warmed take at most half of it, leaving the rest for prompt chunks' sizes.
PRIMITIVE_CACHE_ENTRIES = 1024


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where oneDNN prepacking is available and pays: float32 on CPU, bfloat16 where it is native."""
    return (
        device.type == "cpu"
        and str(dtype).removeprefix("torch.") in CPU_PREPACKED_DTYPES
        and (dtype != torch.bfloat16 or cpu_isa().native_bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PrepackedLinear(nn.Module):
    """The same y = x W^T + b as the nn.Linear it replaces, with W held in oneDNN's layout."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # The plain weight stays the module's parameter (state_dict, weight sharing, introspection).
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), batch_size=batch_size_hint
        )
        self.dense_rows = dense_rows(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes(x):
            return dense_linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """`forward(x).float()` (the LM head's logits): where dense_linear takes x, it writes the float32
        values itself, without a bfloat16 output and a second pass over it."""
        if self._takes(x):
            return dense_linear(x, self.weight, self.bias, out_dtype=torch.float32)
        return self.forward(x).float()

    def _takes(self, x: torch.Tensor) -> bool:
        """Whether dense_linear multiplies x here."""
        return (
            0 < x.shape[0] <= self.dense_rows
            and x.dim() == 2
            and x.dtype == self.weight.dtype
            and x.is_contiguous()
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def dense_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Up to how many rows `dense_linear` multiplies by `weight` (and `bias`): 0 where the C kernels are
    unavailable, do not run it vectorized for this dtype, or cannot read these tensors as they are."""
    tensors = (weight,) if bias is None else (weight, bias)
    library = cpu_kernels.library_for(*tensors)
    if library is None or weight.dim() != 2 or not all(t.is_contiguous() for t in tensors):
        return 0
    rows: int = library.dense_linear_max_rows(cpu_kernels.DTYPE_CODES[weight.dtype], weight.shape[1])
    return rows


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    library: ctypes.CDLL | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x W^T (+ b) by cpu/kernels.c's `dense_linear`, for x [rows, in] contiguous with rows at most
    `dense_rows(weight, bias)`, all of one dtype. `out_dtype`: x's (None), or float32: x's result widened.
    `library`: another build of the kernels than this process's (for tests)."""
    if library is None:
        library = cpu_kernels.library()
    assert library is not None
    rows, k = x.shape
    out = x.new_empty((rows, weight.shape[0]), dtype=out_dtype)
    status = library.dense_linear(
        x.data_ptr(),
        rows,
        k,
        weight.data_ptr(),
        weight.shape[0],
        None if bias is None else bias.data_ptr(),
        cpu_kernels.DTYPE_CODES[x.dtype],
        out.data_ptr(),
        cpu_kernels.DTYPE_CODES[out.dtype],
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"dense_linear takes 1 to {dense_rows(weight, bias)} rows of {x.dtype} into {x.dtype} or "
            f"torch.float32, not {rows} into {out.dtype} (or its copy of x could not be allocated)"
        )
    return out


def prepack_linears(model: nn.Module, batch_size_hint: int) -> int:
    """Replace every nn.Linear inside `model` by a PrepackedLinear; return how many were replaced.

    A model whose LM head is its embedding (tied, `lm_head` None) gets a prepacked LM head over the
    embedding weight: MKL runs the [batch, hidden] x [vocab, hidden]^T logits product 2-3.5x slower than
    oneDNN with the weight prepacked (SmolLM2's 49152 x 576 at batch 8 / 64), at the cost of one packed
    copy of the embedding."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PrepackedLinear(child, batch_size_hint))
                replaced += 1
    embed = getattr(model, "embed_tokens", None)
    if hasattr(model, "lm_head") and model.lm_head is None and isinstance(embed, nn.Embedding):
        vocab, hidden = embed.weight.shape
        tied = nn.Linear(hidden, vocab, bias=False, device="meta")
        tied.weight = embed.weight  # shared: the packed copy is the only extra memory
        model.lm_head = PrepackedLinear(tied, batch_size_hint)
        replaced += 1
    return replaced


def prepare_linears(model: nn.Module, max_batch_size: int) -> None:
    """What a loaded CPU model gets before serving (engine and tensor-parallel ranks alike): prepacked
    projections, the weights the C products stream on huge pages, and oneDNN's GEMMs built for every decode
    batch size up to `max_batch_size` (the slots)."""
    prepack_linears(model, batch_size_hint=max_batch_size)
    huge_pages.hold_on_huge_pages(streamed_weights(model), "weights")
    warm_batch_sizes(model, max_batch_size)


def streamed_weights(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the C products read a whole pass of in every decode step: the plain float weights and
    biases (parameters), and, where the C kernels are built, each kept-quantized weight's blocks and
    scales, put into the kernels' layout here (what its first product would do)."""
    tensors: list[torch.Tensor] = list(model.parameters())
    if cpu_kernels.library() is None:
        return tensors
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedTensor):
            weight.interleave_()
            tensors += [t for t in (weight.qweight, weight.scales, weight.mins) if t is not None]
    return tensors


def warm_batch_sizes(model: nn.Module, max_batch_size: int) -> int:
    """Run every distinct projection shape of `model` once at each batch size 1..`max_batch_size` (what
    a decode step of that many sequences multiplies), so that oneDNN has built those GEMM primitives
    before the first request: the first product of a shape at a new batch size costs about 0.6 ms more
    than the next (docs/benchmarks.md). Return how many sizes were warmed."""
    by_shape: dict[tuple[int, int, bool], PrepackedLinear] = {}
    for module in model.modules():
        if isinstance(module, PrepackedLinear):
            by_shape.setdefault((module.out_features, module.in_features, module.bias is None), module)
    if not by_shape:
        return 0
    sizes = min(max_batch_size, PRIMITIVE_CACHE_ENTRIES // (2 * len(by_shape)))
    started = time.perf_counter()
    with torch.inference_mode():
        for rows in range(1, sizes + 1):
            for linear in by_shape.values():
                linear(torch.zeros(rows, linear.in_features, dtype=linear.weight.dtype))
    logger.debug(
        "oneDNN GEMMs built for batch sizes 1..%d x %d shapes in %.2f s",
        sizes,
        len(by_shape),
        time.perf_counter() - started,
    )
    return sizes
