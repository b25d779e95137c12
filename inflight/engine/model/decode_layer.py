"""A decode step's decoder layers in one C call, where the projections are kept quantized or are float
weights multiplied in C (CPU).

The per-op path (model/llama.py: RMSNorm, the qkv product, rotary, the KV write, attention, o_proj,
RMSNorm, gate_up, SiLU * up, down) made about ten Python calls a layer, each with its checks, allocations
and ctypes call: at batch 1 more time than the layer's quantized products, ~0.2 ms a layer beside a float
SmolLM2 layer's ~0.3-0.8 ms of products at one to four rows. `decode_layers` in engine/cpu/decode_layer.c
runs the same kernels with the same arguments, a whole run of layers (`LayerRun`) in one call, so a decode
step's outputs are bit-identical to the per-op path (tests/engine/test_decode_layer.py,
tests/engine/test_dense_layer.py). One Python call a layer, with its checks, still cost ~0.2 ms of a ~10
ms SmolLM2 bfloat16 step at batch 1 (docs/models.md). A speculative verify step's rows are each a one-token
decode here, bit for bit the same row decoded alone, where the per-op path gives its sequences' rows to the
prompt kernel (the two agree within rounding).

It runs a step whose sequences have a few new rows each (AttentionMetadata.is_short_queries: decode steps,
verify steps), every row as a one-token decode (rows_as_decodes), float32 or bfloat16 activations, on one
rank, with the C kernels available, with every layer's K and V caches of one shape and dtype, contiguous
(`LayerCaches`), where every projection of the layer is
- a `QuantizedLinear` (products by quant_linear): the rows the per-op path would also give the kernel
  (`quantized.kernel_takes`: the run_model of a decode step takes any count where the kernel rounds x to
  int8, else at most KERNEL_MAX_ROWS rows), a KV cache of the activations' dtype or float8;
- a `PrepackedLinear` that multiplies rows in C (products by dense_linear): no more than the projections'
  `PrepackedLinear.dense_rows`, a KV cache of the activations' dtype.
Anything else takes the per-op path.
"""

from __future__ import annotations

import ctypes
import operator
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby, repeat
from typing import Any

import torch
from torch import nn

from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.linear import PrepackedLinear
from inflight.engine.cpu.quantized import QuantizedLinear, kernel_takes

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64

# struct decode_layer_weights' `product` (decode_layer.c): the kernel that multiplies the layer's matrices.
QUANTIZED = 0  # quant_linear
DENSE = 1  # dense_linear


class _Matrix(ctypes.Structure):
    """struct matrix (decode_layer.c)."""

    _fields_ = [
        ("weight", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("bias", _ptr),
        ("rows", _i64),
        ("format", _i64),
    ]


class _LayerWeights(ctypes.Structure):
    """struct decode_layer_weights (decode_layer.c)."""

    _fields_ = [
        ("product", _i64),
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
    """struct decode_step (decode_layer.c)."""

    _fields_ = [
        ("positions", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("positions_held", _i64),
        ("token_ids", _ptr),
        ("embedding", _ptr),
        ("vocab", _i64),
        ("final_norm", _ptr),
        ("final_eps", ctypes.c_float),
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
        ("kv_dtype", _i64),
        ("num_threads", _i64),
    ]


def _bias(linear: QuantizedLinear | PrepackedLinear) -> int | None:
    return None if linear.bias is None else linear.bias.data_ptr()


def _quantized(linear: QuantizedLinear) -> tuple[_Matrix, list[torch.Tensor]]:
    """The matrix of a QuantizedLinear, and the tensors it points into besides the bias."""
    weight = linear.weight.interleave_()
    matrix = _Matrix(
        weight.qweight.data_ptr(),
        weight.scales.data_ptr(),
        None if weight.mins is None else weight.mins.data_ptr(),
        _bias(linear),
        weight.shape[0],
        weight.kernel_code,
    )
    return matrix, [t for t in (weight.qweight, weight.scales, weight.mins) if t is not None]


def _dense(linear: PrepackedLinear) -> tuple[_Matrix, list[torch.Tensor]]:
    """The matrix of a PrepackedLinear, and the tensors it points into besides the bias."""
    matrix = _Matrix(linear.weight.data_ptr(), None, None, _bias(linear), linear.out_features, 0)
    return matrix, [linear.weight]


def _weight(norm: nn.Module) -> torch.Tensor:
    """An RMSNorm's weight."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    return weight


Projection = QuantizedLinear | PrepackedLinear


# Where an object's attribute is held: the dict (a module's `_parameters`, `_buffers` or `_modules`, else the
# object's `__dict__`) and the name in it.
Slot = tuple[dict[str, Any], str]
# What a slot's dict gives for a name it does not hold.
_ABSENT = object()


def slot(owner: object, name: str) -> Slot:
    """Where `owner.name` is held (see Slot)."""
    if isinstance(owner, nn.Module):
        for held in (owner._parameters, owner._buffers, owner._modules):
            if name in held:
                return held, name
    return vars(owner), name


class Links:
    """What something was built from: objects, each with the slot it was read from, and the addresses of
    tensors. `current()`: every slot still holds its object and every tensor is at its address (a module's
    `.to()` keeps its tensors but moves their data), so what was built from them still stands.

    It is one pass of C-level maps over dicts, no nn.Module.__getattr__: a decode step checks its layers'
    one-call forms this way (about 1.5 us a layer in a hot loop, where reading the modules through their
    attributes cost about 15; docs/benchmarks.md)."""

    def __init__(
        self,
        slots: Sequence[Slot],
        objects: Sequence[object],
        tensors: Sequence[torch.Tensor],
        addresses: Sequence[int],
    ) -> None:
        """Use `of` or `joined`: `objects` are what `slots` held, `addresses` where `tensors` were."""
        self._dicts = tuple(held for held, _ in slots)
        self._names = tuple(name for _, name in slots)
        self._objects = tuple(objects)
        self._tensors = tuple(tensors)
        self._addresses = list(addresses)

    @staticmethod
    def of(slots: Sequence[Slot], tensors: Sequence[torch.Tensor]) -> Links:
        """What `slots` hold now, and where `tensors` are."""
        return Links(slots, [held.get(name, _ABSENT) for held, name in slots], tensors, _addresses(tensors))

    @staticmethod
    def joined(parts: Sequence[Links]) -> Links:
        """One Links for all of `parts`, with the objects and addresses they recorded."""
        return Links(
            [(held, name) for part in parts for held, name in zip(part._dicts, part._names, strict=True)],
            [obj for part in parts for obj in part._objects],
            [t for part in parts for t in part._tensors],
            [address for part in parts for address in part._addresses],
        )

    def current(self) -> bool:
        """Whether every slot holds the object it held and every tensor is where it was."""
        found = map(dict.get, self._dicts, self._names, repeat(_ABSENT))
        return all(map(operator.is_, found, self._objects)) and _addresses(self._tensors) == self._addresses


def _addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, tensors))


class FusedLayer:
    """A decoder layer's weights as decode_layer.c reads them: the pointers, and the tensors they point
    into (held, so the pointers stay valid). Whether they are still the layer's is the layer's `Links`."""

    def __init__(
        self,
        norms: tuple[nn.Module, nn.Module],
        eps: float,
        projections: tuple[Projection, Projection, Projection, Projection],
        attention: tuple[int, int, int, float],
    ) -> None:
        """`norms`: the two RMSNorms; `projections`: qkv, o, gate_up, down, all QuantizedLinear or all
        PrepackedLinear; `attention`: num_heads, num_kv_heads, head_dim, scale."""
        qkv, o, _, down = projections
        num_heads, num_kv_heads, head_dim, scale = attention
        parts = [_quantized(p) if isinstance(p, QuantizedLinear) else _dense(p) for p in projections]
        tensors = [_weight(n) for n in norms] + [p.bias for p in projections if p.bias is not None]
        tensors += [t for _, held in parts for t in held]
        self._tensors = tuple(tensors)
        self.dtype = _weight(norms[0]).dtype
        self.kv_shape = (num_kv_heads, head_dim)
        self.product = QUANTIZED if isinstance(qkv, QuantizedLinear) else DENSE
        # The most rows every product of the layer takes in C (quantized: `kernel_takes`, the same for
        # every layer, decides at the step's start), and the KV cache dtypes the layer's step takes.
        self.max_rows = sys.maxsize
        self.kv_dtypes: tuple[torch.dtype, ...] = (self.dtype, torch.float8_e4m3fn)
        if self.product == DENSE:
            self.max_rows = min(p.dense_rows for p in projections if isinstance(p, PrepackedLinear))
            self.kv_dtypes = (self.dtype,)
        matrices = [matrix for matrix, _ in parts]
        self.weights = _LayerWeights(
            self.product,
            _weight(norms[0]).data_ptr(),
            _weight(norms[1]).data_ptr(),
            *matrices,
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
    ) -> FusedLayer | None:
        """A FusedLayer where every projection is a QuantizedLinear, the norms' weights and the biases
        sharing one kernel dtype, or every projection is a PrepackedLinear that multiplies rows in C, the
        norms' weights sharing its dtype; else None."""
        quantized = [p for p in projections if isinstance(p, QuantizedLinear)]
        dense = [p for p in projections if isinstance(p, PrepackedLinear) and p.dense_rows > 0]
        chosen: list[QuantizedLinear] | list[PrepackedLinear]
        if len(quantized) == len(projections):
            chosen = quantized
            floats = [_weight(n) for n in norms] + [p.bias for p in quantized if p.bias is not None]
            dtype = floats[0].dtype
        elif len(dense) == len(projections):
            chosen = dense
            floats = [_weight(n) for n in norms] + [p.weight for p in dense]
            dtype = dense[0].weight.dtype
        else:
            return None
        if dtype not in cpu_kernels.DTYPE_CODES:
            return None
        if any(t.dtype != dtype or not t.is_contiguous() for t in floats):
            return None
        qkv, o, gate_up, down = chosen
        return FusedLayer(norms, eps, (qkv, o, gate_up, down), attention)


class LayerRun:
    """Consecutive one-call layers of a model that share the activations' dtype, the product kind and the K
    and V caches' shapes and dtypes: a decode step runs them in one C call. `start`: the first one's index
    among the model's layers; `weights`: each layer's struct decode_layer_weights, as decode_layers reads
    them (the layers are held, so the pointers stay valid)."""

    def __init__(self, start: int, layers: Sequence[FusedLayer]) -> None:
        first = layers[0]
        self.start = start
        self.end = start + len(layers)
        self._layers = tuple(layers)
        self.weights = (_ptr * len(layers))(*(ctypes.addressof(layer.weights) for layer in layers))
        self.dtype, self.product = first.dtype, first.product
        self.kv_shape, self.kv_dtypes = first.kv_shape, first.kv_dtypes
        self.max_rows = min(layer.max_rows for layer in layers)

    @staticmethod
    def runs(layers: Sequence[FusedLayer | None]) -> tuple[LayerRun, ...]:
        """The runs of a model's layers (None: a layer without a one-call form), each as long as the layers
        agree (see the class)."""
        runs = []
        for kind, group in groupby(enumerate(layers), key=lambda item: _run_kind(item[1])):
            if kind is not None:
                indexed = list(group)
                runs.append(LayerRun(indexed[0][0], [layer for _, layer in indexed if layer is not None]))
        return tuple(runs)

    def takes_rows(self, rows: int, library: ctypes.CDLL) -> bool:
        """Whether every product of the run's layers multiplies `rows` rows in C here."""
        return rows <= self.max_rows and (self.product == DENSE or kernel_takes(rows, library))


def _run_kind(layer: FusedLayer | None) -> tuple[object, ...] | None:
    """What the layers of one LayerRun share."""
    if layer is None:
        return None
    return layer.dtype, layer.product, layer.kv_shape, layer.kv_dtypes


class LayerCaches:
    """A model's K and V caches, one pair a layer, as decode_layers reads them: each layer's K and V
    addresses, and the one dtype and shape ([blocks, block_size, kv heads, head dim]) of them all where they
    share them, contiguous on the CPU (`dtype` None otherwise: no one-call step). Kept while `current`: the
    same tensors at the same addresses (it holds them)."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._tensors = _flat(kv_caches)
        self._addresses = _addresses(self._tensors)
        self.k = (_ptr * len(kv_caches))(*(k.data_ptr() for k, _ in kv_caches))
        self.v = (_ptr * len(kv_caches))(*(v.data_ptr() for _, v in kv_caches))
        first = self._tensors[0]
        alike = all(
            t.dtype == first.dtype and t.shape == first.shape and t.is_cpu and t.is_contiguous()
            for t in self._tensors
        )
        self.dtype = first.dtype if alike else None
        self.shape = first.shape

    def current(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether `kv_caches` are the tensors these were read from, still at their addresses."""
        tensors = _flat(kv_caches)
        return (
            len(tensors) == len(self._tensors)
            and all(map(operator.is_, tensors, self._tensors))
            and _addresses(tensors) == self._addresses
        )


def _flat(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(t for pair in kv_caches for t in pair)


# decode_layers' refusals of its inputs (decode_layer.c).
_TOKEN_OUT_OF_RANGE = -2
_POSITION_OUT_OF_RANGE = -3


@dataclass(frozen=True)
class ModelEnds:
    """What a decode step reads around the model's layers (decode_layer.c), as the C call can read it, built
    once with the plan (`of`): the activations' dtype (the embedding lookup's); the embedding table the C
    call looks the rows up in (None: the model looks them up); the rotary tables [positions, head_dim / 2]
    (`rotary_usable`: float32, contiguous, of one shape; else no one-call step); the last RMSNorm's weight,
    which the C call applies after the model's last layer (None: the model applies it), and its eps."""

    dtype: torch.dtype
    embedding: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    rotary_usable: bool
    final_norm: torch.Tensor | None
    norm_eps: float

    @staticmethod
    def of(
        dtype: torch.dtype,
        table: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        norm: tuple[torch.Tensor, float],
    ) -> ModelEnds:
        """`table`: the embedding table (None: kept quantized, or split over ranks); `rope`: the rotary
        tables (cos, sin); `norm`: the last RMSNorm's weight and eps. Each is kept for the C call where it
        can read it."""
        cos, sin = rope
        norm_weight, eps = norm

        def readable(t: torch.Tensor) -> bool:
            return t.dtype == dtype and t.is_cpu and t.is_contiguous()

        rotary_usable = (
            cos.dtype == sin.dtype == torch.float32
            and cos.dim() == 2
            and cos.shape == sin.shape
            and cos.is_contiguous()
            and sin.is_contiguous()
        )
        embedding = table if table is not None and readable(table) else None
        final_norm = norm_weight if readable(norm_weight) else None
        return ModelEnds(dtype, embedding, cos, sin, rotary_usable, final_norm, eps)


class DecodeStep:
    """A decode-only step's rows as decode_layer.c reads them: made once a step, run once per LayerRun."""

    def __init__(
        self,
        library: ctypes.CDLL,
        ends: ModelEnds,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: LayerCaches,
        kv_dtype: torch.dtype,
    ) -> None:
        """Use `start`: `kv_dtype` is `caches`' (not None)."""
        query_rows, seqs, lens = meta.rows_as_decodes
        slots = meta.slot_mapping.contiguous()
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        embedding, norm = ends.embedding, ends.final_norm
        self.dtype = ends.dtype
        self.embeds = embedding is not None
        self.normalizes = norm is not None
        # Held: the step struct points into them (and into the ends' tensors).
        self._tensors = (positions, input_ids, slots, block_tables, lens, query_rows, seqs)
        self._ends = ends
        self._library = library
        self._caches = caches
        self.kv_dtype = kv_dtype
        self.kv_shape = caches.shape[2:]
        self.args = _Step(
            positions.data_ptr(),
            ends.cos.data_ptr(),
            ends.sin.data_ptr(),
            ends.cos.shape[0],
            input_ids.data_ptr(),
            None if embedding is None else embedding.data_ptr(),
            0 if embedding is None else embedding.shape[0],
            None if norm is None else norm.data_ptr(),
            ends.norm_eps,
            slots.data_ptr(),
            block_tables.data_ptr(),
            lens.data_ptr(),
            query_rows.data_ptr(),
            seqs.data_ptr(),
            input_ids.shape[0],
            block_tables.stride(0),
            caches.shape[1],
            meta.sliding_window or 0,
            meta.max_seq_len,
            cpu_kernels.DTYPE_CODES[self.dtype],
            cpu_kernels.KV_DTYPE_CODES[kv_dtype],
            torch.get_num_threads(),
        )

    @staticmethod
    def start(
        run: LayerRun | None,
        ends: ModelEnds,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: LayerCaches,
    ) -> DecodeStep | None:
        """The step of the tokens `input_ids` at `positions`, where decode_layer.c can run it with `run` (the
        model's first; see the top of the file), else None."""
        if run is None or not meta.is_short_queries:
            return None
        cos = ends.cos
        library = cpu_kernels.library() if ends.dtype in cpu_kernels.DTYPE_CODES and cos.is_cpu else None
        if library is None or input_ids.dim() != 1:
            return None
        rows = input_ids.shape[0]
        if not run.takes_rows(rows, library):
            return None
        # head_dim / 2 rotary values a position: the rows the C call reads.
        tables_usable = ends.rotary_usable and cos.shape[1] * 2 == caches.shape[-1]
        rows_usable = all(
            t.dtype == torch.int64 and t.is_cpu and t.is_contiguous() and t.shape == (rows,)
            for t in (input_ids, positions, meta.slot_mapping)
        )
        kv_dtype = caches.dtype
        if kv_dtype is None or kv_dtype not in run.kv_dtypes or not (tables_usable and rows_usable):
            return None
        return DecodeStep(library, ends, input_ids, positions, meta, caches, kv_dtype)

    def takes(self, run: LayerRun) -> bool:
        """True where `run` can run this step's rows with the step's caches (a later run's product kind may
        take fewer rows than the first's)."""
        return (
            run.dtype == self.dtype
            and run.takes_rows(self.args.rows, self._library)
            and self.kv_dtype in run.kv_dtypes
            and self.kv_shape == run.kv_shape
        )

    def run(
        self,
        run: LayerRun,
        end: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        last: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer end - 1's MLP output, the residual stream before it), as DecoderLayer.forward returns
        them, after the run's layers up to `end` (run.start < end <= run.end): `hidden` and `residual` are
        updated in place. For the model's first layer residual is None, and `hidden` holds the embeddings,
        or is filled with them here where the step `embeds`. `last` (where the step `normalizes`): `end` is
        the model's last layer, and `hidden` ends as the model's output (its last norm applied)."""
        first = residual is None
        if residual is None:
            residual = torch.empty_like(hidden)
        caches, offset = self._caches, run.start * ctypes.sizeof(_ptr)
        status = self._library.decode_layers(
            ctypes.addressof(run.weights),
            ctypes.addressof(caches.k) + offset,
            ctypes.addressof(caches.v) + offset,
            end - run.start,
            ctypes.addressof(self.args),
            hidden.data_ptr(),
            residual.data_ptr(),
            int(first),
            int(last),
        )
        if status == _TOKEN_OUT_OF_RANGE:
            raise IndexError(f"a token id is outside the vocabulary's {self.args.vocab} ids")
        if status == _POSITION_OUT_OF_RANGE:
            raise IndexError(f"a position is outside the {self.args.positions_held} the rotary tables hold")
        if status != 0:
            raise MemoryError("decode_layers: a buffer could not be allocated or a kernel refused")
        return hidden, residual
