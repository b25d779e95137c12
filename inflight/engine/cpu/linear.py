"""Linear layers with oneDNN-prepacked weights, for float32 (and native bfloat16) inference on CPU.

PyTorch's default CPU GEMM (MKL sgemm) runs the engine's small-batch projections at a fraction of the
machine's speed; oneDNN with the weight reordered once into its blocked layout is faster on them
(measurements: docs/benchmarks.md). bfloat16 is prepacked too where the CPU runs it natively
(AVX512-BF16 / AMX, cpu/isa.py): oneDNN's bf16 kernels there are about 2x its float32 ones. The engine
swaps the decoder layers' projections after loading; CUDA and other dtypes are left alone.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from inflight.engine.cpu.isa import cpu_isa

logger = logging.getLogger("inflight.engine")

# oneDNN keeps its GEMM primitives in one process-wide LRU cache of 1024 (its default capacity). The
# batch sizes warmed take at most half of it, leaving the rest for prompt chunks' sizes.
PRIMITIVE_CACHE_ENTRIES = 1024


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where oneDNN prepacking is available and pays: float32 on CPU, bfloat16 where it is native."""
    return (
        device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_isa().native_bfloat16))
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


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
    projections, and oneDNN's GEMMs built for every decode batch size up to `max_batch_size` (the slots)."""
    prepack_linears(model, batch_size_hint=max_batch_size)
    warm_batch_sizes(model, max_batch_size)


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
