"""A decode step's decoder layers, one C call each, where the projections are float weights (CPU).

At one to four rows the products run in C (cpu/linear.py's `dense_linear`) and a SmolLM2 layer's take
~0.4-0.8 ms, while the per-op path (model/llama.py: RMSNorm, the qkv product, rotary, the KV write,
attention, o_proj, RMSNorm, gate_up, SiLU * up, down) adds ten Python calls a layer, each with its checks,
allocations and ctypes call: ~0.2 ms a layer. `dense_decode_layer` in engine/cpu/dense_layer.c runs the
same kernels with the same arguments in one call, so its outputs are bit-identical to the per-op path
(tests/engine/test_dense_layer.py). model/decode_layer.py does the same for weights kept quantized.

It runs a step of only decode rows (AttentionMetadata.is_decode_only), no more than the projections'
`PrepackedLinear.dense_rows`, float32 or bfloat16, with a KV cache of that dtype, on one rank, with the C
attention kernels; anything else takes the per-op path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.linear import PrepackedLinear

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


class _Matrix(ctypes.Structure):
    """struct dense_matrix (dense_layer.c)."""

    _fields_ = [("weight", _ptr), ("bias", _ptr), ("rows", _i64)]


class _LayerWeights(ctypes.Structure):
    """struct dense_layer_weights (dense_layer.c)."""

    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


class _Step(ctypes.Structure):
    """struct dense_step (dense_layer.c)."""

    _fields_ = [
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("lens", _ptr),
        ("query_rows", _ptr),
        ("seqs", _ptr),
        ("rows", _i64),
        ("table_stride", _i64),
        ("block_size", _i64),
        ("window", _i64),
        ("max_seq_len", _i64),
        ("dtype", _i64),
        ("num_threads", _i64),
    ]


def _matrix(linear: PrepackedLinear) -> _Matrix:
    bias = linear.bias
    return _Matrix(linear.weight.data_ptr(), None if bias is None else bias.data_ptr(), linear.out_features)


def _weight(norm: nn.Module) -> torch.Tensor:
    """An RMSNorm's weight."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    return weight


Projections = tuple[PrepackedLinear, PrepackedLinear, PrepackedLinear, PrepackedLinear]


class DenseLayer:
    """A decoder layer's weights as dense_layer.c reads them: the pointers, and the modules and tensors they
    come from (held, so the pointers stay valid; `current` says whether they are still the layer's)."""

    def __init__(
        self,
        norms: tuple[nn.Module, nn.Module],
        eps: float,
        projections: Projections,
        attention: tuple[int, int, int, float],
    ) -> None:
        """`norms`: the two RMSNorms; `projections`: qkv, o, gate_up, down; `attention`: num_heads,
        num_kv_heads, head_dim, scale."""
        qkv, o, gate_up, down = projections
        num_heads, num_kv_heads, head_dim, scale = attention
        tensors = [_weight(n) for n in norms] + [p.weight for p in projections]
        tensors += [p.bias for p in projections if p.bias is not None]
        self.modules = (*norms, *projections)
        self._weights = tuple((p, p.weight, p.bias) for p in projections)
        self._pointers = tuple((t, t.data_ptr()) for t in tensors)
        self.dtype = _weight(norms[0]).dtype
        self.kv_shape = (num_kv_heads, head_dim)
        # The most rows every product of the layer takes in C.
        self.max_rows = min(p.dense_rows for p in projections)
        self.weights = _LayerWeights(
            _weight(norms[0]).data_ptr(),
            _weight(norms[1]).data_ptr(),
            _matrix(qkv),
            _matrix(o),
            _matrix(gate_up),
            _matrix(down),
            o.out_features,
            num_heads,
            num_kv_heads,
            head_dim,
            down.in_features,
            eps,
            scale,
        )

    @staticmethod
    def of(
        norms: tuple[nn.Module, nn.Module],
        eps: float,
        projections: tuple[nn.Module, nn.Module, nn.Module, nn.Module],
        attention: tuple[int, int, int, float],
    ) -> DenseLayer | None:
        """A DenseLayer where every projection is a PrepackedLinear that multiplies rows in C and the
        norms' weights share its dtype, else None."""
        prepacked = [p for p in projections if isinstance(p, PrepackedLinear) and p.dense_rows > 0]
        if len(prepacked) != len(projections):
            return None
        dtype = prepacked[0].weight.dtype
        floats = [_weight(n) for n in norms] + [p.weight for p in prepacked]
        if dtype not in cpu_kernels.DTYPE_CODES:
            return None
        if any(t.dtype != dtype or not t.is_contiguous() for t in floats):
            return None
        qkv, o, gate_up, down = prepacked
        return DenseLayer(norms, eps, (qkv, o, gate_up, down), attention)

    def current(self, modules: tuple[nn.Module, ...]) -> bool:
        """Whether the layer's modules are still `modules` (norms, then qkv, o, gate_up, down), with the
        same weights where they were (a replaced weight or a tensor moved by `.to()` is not)."""
        return (
            all(a is b for a, b in zip(modules, self.modules, strict=True))
            and all(p.weight is w and p.bias is b for p, w, b in self._weights)
            and all(t.data_ptr() == ptr for t, ptr in self._pointers)
        )


class DenseStep:
    """A decode-only step's rows as dense_layer.c reads them: made once a step, run once per layer."""

    def __init__(
        self,
        library: ctypes.CDLL,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
    ) -> None:
        cos, sin = rope
        query_rows, seqs, lens = meta.decode_rows
        slots = meta.slot_mapping.contiguous()
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        # Held: the step struct points into them.
        self._tensors = (cos, sin, slots, block_tables, lens, query_rows, seqs)
        self._library = library
        self.dtype = hidden.dtype
        self.args = _Step(
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            lens.data_ptr(),
            query_rows.data_ptr(),
            seqs.data_ptr(),
            hidden.shape[0],
            block_tables.stride(0),
            k_cache.shape[1],
            meta.sliding_window or 0,
            meta.max_seq_len,
            cpu_kernels.DTYPE_CODES[hidden.dtype],
            torch.get_num_threads(),
        )

    @staticmethod
    def start(
        layer: DenseLayer | None,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
    ) -> DenseStep | None:
        """The step, where dense_layer.c can run it with `layer` (the first layer's; see the top of the
        file), else None. `rope`: the step's cos and sin from ops.rotary_tables; `k_cache`: a layer's
        (every layer's is alike)."""
        if layer is None or not meta.is_decode_only or hidden.dim() != 2 or hidden.shape[0] > layer.max_rows:
            return None
        library = cpu_kernels.library_for(hidden)
        if library is None:
            return None
        cos, sin = rope
        tables_usable = (
            cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        )
        kv_usable = (
            k_cache.is_cpu and k_cache.dtype == hidden.dtype and meta.slot_mapping.dtype == torch.int64
        )
        if not (tables_usable and kv_usable and hidden.is_contiguous()):
            return None
        return DenseStep(library, hidden, meta, rope, k_cache)

    def takes(self, layer: DenseLayer, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """True where `run` can run this layer with these caches ([blocks, block_size, kv heads, head
        dim], contiguous, the step's dtype)."""
        return (
            layer.dtype == self.dtype
            and self.args.rows <= layer.max_rows
            and k_cache.dtype == v_cache.dtype == self.dtype
            and k_cache.shape == v_cache.shape
            and k_cache.shape[1] == self.args.block_size
            and k_cache.shape[2:] == layer.kv_shape
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )

    def run(
        self,
        layer: DenseLayer,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's MLP output, the residual stream before it), as DecoderLayer.forward returns them:
        `hidden` and `residual` (made for the first layer, residual None) are updated in place."""
        first = residual is None
        if residual is None:
            residual = torch.empty_like(hidden)
        status = self._library.dense_decode_layer(
            ctypes.addressof(layer.weights),
            ctypes.addressof(self.args),
            hidden.data_ptr(),
            residual.data_ptr(),
            int(first),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
        if status != 0:
            raise MemoryError("dense_decode_layer: could not allocate its buffers")
        return hidden, residual
