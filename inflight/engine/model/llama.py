"""A Llama-family decoder (Llama, Qwen2, Mistral) whose attention reads and writes a paged KV cache.

The batch is flattened (see attention/metadata.py): `input_ids` and `positions` are [T] for all the
step's new tokens. q/k/v and gate/up projections are fused into one matmul each; the loader maps the
checkpoint's separate tensors into their row ranges (`weight_targets`).

Tensor parallel: built with a `ShardLayout` of size N > 1, the model holds one rank's slices (see
model/shard_layout.py) and sums the partial outputs of o_proj, down_proj and the embedding over the ranks,
and gathers the LM head's vocabulary slices; with size 1 (the default) no collective runs.

On the hot path (the layer loop) submodules are called through `.forward()`: nn.Module.__call__'s hook
handling costs about 2 us a call, 10 calls a layer, which over 30 thin layers was a few percent of a
small decode step. The model registers no hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from inflight.engine.attention.backend import CPU_KERNEL_BACKEND, AttentionBackend
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.cpu.linear import PrepackedLinear
from inflight.engine.cpu.quantized import QuantizedLinear, QuantizedTensor, quantized_linear
from inflight.engine.fp8.weights import Fp8Linear, Fp8Weight
from inflight.engine.model import ops
from inflight.engine.model.collectives import all_reduce_sum, gather_vocab
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.decode_layer import (
    DecodeStep,
    FusedLayer,
    LayerCaches,
    LayerRun,
    Links,
    ModelEnds,
    slot,
)
from inflight.engine.model.shard_layout import ShardLayout


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized h, h) for h = x + residual (x alone without one); see ops.rms_norm."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2], float32, with the checkpoint's scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: leave high frequencies alone, divide low ones by `factor`, interpolate in between.
    old_context = scaling.original_max_position_embeddings or config.max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# cos and sin of the step's positions, [T, 1, head_dim / 2] each (see ops.rotary_tables).
Rope = tuple[torch.Tensor, torch.Tensor]
# Rows of the step's new tokens to keep, and the attention metadata of those rows alone.
RowSelection = tuple[torch.Tensor, AttentionMetadata]


class RotaryEmbedding:
    """cos/sin for every position up to max_position_embeddings, computed once in float32."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        inv_freq = rope_inv_freq(config, device)
        positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def __call__(self, positions: torch.Tensor) -> Rope:
        """cos and sin of `positions`: looked up once per step, used by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def shard_layout(config: ModelConfig, rank: int = 0, size: int = 1) -> ShardLayout:
    """What rank `rank` of `size` holds of this model; raises ValueError naming the valid sizes."""
    return ShardLayout(
        rank,
        size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    )


class Attention(nn.Module):
    """This rank's heads: q/k/v column-parallel by head, o_proj row-parallel (partial sums all-reduced)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: ShardLayout) -> None:
        super().__init__()
        self.num_heads = layout.heads
        self.num_kv_heads = layout.kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.tp_size = layout.size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        # The bias is added once: by rank 0, before the partial outputs are summed.
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias and layout.rank == 0)
        self.backend = backend

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: RowSelection | None = None,
    ) -> torch.Tensor:
        """Attention output of every new token, or with `keep` of only its rows (every token's K/V is
        written either way)."""
        cos, sin = rope
        q, k, v = ops.split_qkv_with_rotary(
            self.qkv_proj.forward(hidden), self.num_heads, self.num_kv_heads, self.head_dim, cos, sin
        )
        self.backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if keep is not None:
            rows, meta = keep
            q = q[rows]
        out = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale)
        projected: torch.Tensor = self.o_proj.forward(out.reshape(q.shape[0], self.q_size))
        return all_reduce_sum(projected) if self.tp_size > 1 else projected


class MLP(nn.Module):
    """This rank's share of the intermediate size: gate/up column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, layout: ShardLayout) -> None:
        super().__init__()
        self.intermediate_size = layout.intermediate
        self.tp_size = layout.size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = mlp_row_blocks(x.shape[0], 2 * self.intermediate_size * x.element_size(), x.device)
        if blocks > 1:
            out = torch.cat([self._rows(part) for part in x.tensor_split(blocks)])
        else:
            out = self._rows(x)
        return all_reduce_sum(out) if self.tp_size > 1 else out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj.forward(ops.silu_and_mul(self.gate_up_proj.forward(x)))
        return out


# The largest gate/up product (rows x 2 x intermediate) a CPU MLP makes at once: half of a 32 MiB L3.
# Beyond it the product and SiLU x up stream it through memory; a prompt chunk of Llama-3.2-1B's shape
# (2048 rows x 16384 bfloat16: 64 MiB) runs its MLP 1.07x faster in blocks of 512 rows than whole, where
# SmolLM2's in float32 (24 MiB whole) is the same either way (docs/benchmarks.md, 4 December night).
MLP_BLOCK_BYTES = 16 * 2**20


def mlp_row_blocks(rows: int, row_bytes: int, device: torch.device) -> int:
    """Into how many row blocks (torch.tensor_split's count) a CPU MLP splits `rows` rows whose gate/up
    product takes `row_bytes` each: the fewest that keep each block's product within MLP_BLOCK_BYTES."""
    if device.type != "cpu":
        return 1
    return max(1, min(rows, -(-rows * row_bytes // MLP_BLOCK_BYTES)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layout: ShardLayout) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, layout)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layout)
        self._fused: FusedLayer | None = None
        self._links: Links | None = None  # what `_fused` was built from

    def _parts(
        self,
    ) -> tuple[
        tuple[nn.Module, nn.Module],
        tuple[nn.Module, nn.Module, nn.Module, nn.Module],
        tuple[int, int, int, float],
    ]:
        """(the two norms; the projections qkv, o, gate_up, down; the attention's num_heads, num_kv_heads,
        head_dim and scale): what a one-call layer is built from."""
        attn, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return norms, projections, (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)

    def _one_call_capable(self) -> bool:
        """Whether a decode step may run this layer as one C call: on one rank, with the C attention
        kernels (and then only where its weights are of a kind dense() or fused() takes)."""
        attn = self.self_attn
        return attn.tp_size == 1 and attn.backend is CPU_KERNEL_BACKEND

    def fused(self) -> FusedLayer | None:
        """This layer as one C call of a decode step (model/decode_layer.py), where its projections are
        kept quantized or are float weights multiplied in C, on one rank, with the C attention kernels;
        else None. Built once, kept while what it was built from is the same (`fused_and_links`)."""
        return self.fused_and_links()[0]

    def fused_and_links(self) -> tuple[FusedLayer | None, Links]:
        """fused(), and the Links of what it was built from: the submodules, the attention's settings,
        the norms' and projections' weights and biases (a quantized weight's tensors too) and where their
        tensors are. Rebuilt where any of them changed."""
        if self._links is None or not self._links.current():
            norms, projections, attention = self._parts()
            capable = self._one_call_capable()
            self._fused = (
                FusedLayer.of(norms, self.input_layernorm.eps, projections, attention) if capable else None
            )
            # Read after FusedLayer.of: interleave_ gives a quantized weight new tensors.
            self._links = self._links_of(norms, projections)
        return self._fused, self._links

    def _links_of(
        self,
        norms: tuple[nn.Module, nn.Module],
        projections: tuple[nn.Module, nn.Module, nn.Module, nn.Module],
    ) -> Links:
        attn, mlp = self.self_attn, self.mlp
        slots = [
            slot(self, name) for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
        ]
        slots += [
            slot(attn, name)
            for name in (
                "qkv_proj",
                "o_proj",
                "backend",
                "tp_size",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "scale",
            )
        ]
        slots += [slot(mlp, name) for name in ("gate_up_proj", "down_proj")]
        slots += [slot(norm, name) for norm in norms for name in ("weight", "eps")]
        slots += [slot(p, name) for p in projections for name in ("weight", "bias")]
        held: list[object] = [norm.weight for norm in norms]
        for p in projections:
            held += [p.weight, p.bias]
            if isinstance(p.weight, QuantizedTensor):
                fields = ("format", "qweight", "scales", "mins", "interleaved_rows")
                slots += [slot(p.weight, name) for name in fields]
                held += [getattr(p.weight, name) for name in fields]
        return Links.of(slots, [t for t in held if isinstance(t, torch.Tensor)])

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: RowSelection | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two, so each
        residual add is fused with the RMSNorm after it. The first layer gets residual None.
        With `keep`, both have only the kept rows."""
        normed, residual = self.input_layernorm.forward(hidden, residual)
        attended = self.self_attn.forward(rope, normed, k_cache, v_cache, meta, keep)
        if keep is not None:
            residual = residual[keep[0]]
        normed, residual = self.post_attention_layernorm.forward(attended, residual)
        return self.mlp.forward(normed), residual


def _projection_weights(projection: nn.Module) -> int:
    """A projection's in x out features, in each form the engine keeps one (nn.Linear, PrepackedLinear,
    QuantizedLinear, Fp8Linear)."""
    if not isinstance(projection, nn.Linear | PrepackedLinear | QuantizedLinear | Fp8Linear):
        raise TypeError(f"a decoder layer's projection is a {type(projection).__name__}: no weights to count")
    return projection.in_features * projection.out_features


@dataclass(frozen=True)
class OneCallPlan:
    """The layers' runs of one-call forms (LayerRun, by their first layer's index), what the calls read around
    the layers (`ends`: the embedding, the rotary tables, the last norm), and what they were built from,
    checked once a step (Links.current) instead of once per layer through its modules' attributes.
    `head`: the layer list's entries (and the one past its end: a layer appended), the ends, and the layers up
    to the first one-call layer, whose rules decide whether the step runs in one-call runs (DecodeStep.start);
    `rest`: the layers after it, checked only where the step does (a step of more rows than the layers take
    checks only the head)."""

    runs: dict[int, LayerRun]
    ends: ModelEnds
    head: Links
    rest: Links

    @property
    def first(self) -> LayerRun | None:
        return min(self.runs.items())[1] if self.runs else None

    @staticmethod
    def of(model: LlamaForCausalLM) -> OneCallPlan:
        layers = model.layers
        found = [cast(DecoderLayer, layer).fused_and_links() for layer in layers]
        entries = Links.of(
            [slot(model, "layers"), *((layers._modules, str(i)) for i in range(len(layers) + 1))], ()
        )
        ends, ends_links = _model_ends(model)
        fused = [f for f, _ in found]
        split = next((i + 1 for i, f in enumerate(fused) if f is not None), len(found))
        return OneCallPlan(
            {run.start: run for run in LayerRun.runs(fused)},
            ends,
            Links.joined([entries, ends_links, *(links for _, links in found[:split])]),
            Links.joined([links for _, links in found[split:]]),
        )


def _model_ends(model: LlamaForCausalLM) -> tuple[ModelEnds, Links]:
    """The model's ModelEnds, and the Links of what they were read from."""
    embed, norm, rotary = model.embed_tokens, model.norm, model.rotary
    weight, norm_weight = embed.weight, norm.weight
    slots = [slot(model, name) for name in ("embed_tokens", "norm", "rotary", "layout")]
    slots += [slot(embed, "weight"), slot(norm, "weight"), slot(norm, "eps")]
    slots += [slot(rotary, "cos"), slot(rotary, "sin")]
    tensors = [norm_weight, rotary.cos, rotary.sin]
    if isinstance(weight, torch.Tensor):
        dtype, table = weight.dtype, weight if model.layout.size == 1 else None
        tensors.append(weight)
    else:  # kept quantized (QuantizedEmbedding): looked up in Python, into its dtype
        dtype, table = embed.dtype, None
        slots.append(slot(embed, "dtype"))
    ends = ModelEnds.of(dtype, table, (rotary.cos, rotary.sin), (norm_weight, norm.eps))
    return ends, Links.of(slots, tensors)


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes.

    The checkpoint must hold it with shape `checkpoint_shape`; the part `source` of it (indices per
    dimension, all of it when None) is copied into rows `rows` of `param` (the whole parameter when
    None). `param` None: this rank holds no part of it (the o_proj bias off rank 0)."""

    param: torch.Tensor | QuantizedTensor | Fp8Weight | None
    checkpoint_shape: tuple[int, ...]
    rows: slice | None = None
    source: tuple[slice, ...] | None = None


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral decoder over a paged KV cache; with a `layout` of size N, one rank's shard.

    The model lives on the device it was built for (the rotary tables are created there).
    """

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        device: torch.device,
        layout: ShardLayout | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layout = layout = layout or shard_layout(config)
        self.rotary = RotaryEmbedding(config, device)
        self.embed_tokens = nn.Embedding(layout.vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, layout) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, layout.vocab_rows, bias=False)
        )
        # Each layer's one-call form, and what they were built from (_one_call_plan).
        self._one_call: OneCallPlan | None = None
        # The KV caches of the last one-call step (_layer_caches).
        self._caches: LayerCaches | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        last_rows_of: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's new tokens; their K/V are written into `kv_caches`.

        With `last_rows_of` (sequence indices), only the hidden states of each of those sequences' last new
        token, in that order: the last layer then attends and runs its MLP for those rows alone (for a
        prefill step, one row per prompt instead of every prompt token)."""
        if attn_metadata.sliding_window != self.config.sliding_window:
            attn_metadata = replace(attn_metadata, sliding_window=self.config.sliding_window)
        keep = None if last_rows_of is None else attn_metadata.last_rows(last_rows_of)
        layers = len(self.layers)
        if len(kv_caches) != layers:
            raise ValueError(f"{len(kv_caches)} KV cache pairs for {layers} layers: give one pair a layer")
        last = layers - 1
        # A decode step (or a speculative verify step: a few rows a sequence) runs each run of one-call
        # layers as one C call where it can, by the rules (rows, KV dtype) of the first run (a GGUF file's
        # first layers may hold a type the kernels do not keep). The last layer with `keep` runs per op.
        plan = self._one_call_plan() if kv_caches and attn_metadata.is_short_queries else None
        step = None
        if plan is not None and plan.first is not None:
            caches = self._layer_caches(kv_caches)
            step = DecodeStep.start(plan.first, plan.ends, input_ids, positions, attn_metadata, caches)
        if step is not None and plan is not None and not plan.rest.current():
            # A later layer changed: rebuilt, with the same first layer (its links are current).
            plan = self._one_call = OneCallPlan.of(self)
        runs = plan.runs if step is not None and plan is not None else {}
        end_of_runs = last if keep is not None else layers
        # Where the first layer runs in C, the C call looks the embeddings up (and the rotary values: the
        # per-op layers look theirs up only where one runs).
        first_run = runs.get(0) if end_of_runs > 0 else None
        if step is not None and first_run is not None and step.embeds and step.takes(first_run):
            hidden = torch.empty((input_ids.shape[0], self.config.hidden_size), dtype=step.dtype)
        else:
            hidden = self._embed(input_ids)
        rope: Rope | None = None
        residual: torch.Tensor | None = None
        i = 0
        while i < layers:
            run = runs.get(i)
            if run is not None and step is not None and i < end_of_runs and step.takes(run):
                end = min(run.end, end_of_runs)
                ends_model = end == layers and step.normalizes
                hidden, residual = step.run(run, end, hidden, residual, ends_model)
                if ends_model:
                    return hidden  # the last norm applied in the C call
                i = end
                continue
            if rope is None:
                rope = ops.rotary_tables(*self.rotary(positions), like=hidden)
            k_cache, v_cache = kv_caches[i]
            layer_keep = keep if i == last else None
            hidden, residual = self.layers[i].forward(
                rope, hidden, residual, k_cache, v_cache, attn_metadata, layer_keep
            )
            i += 1
        normed, _ = self.norm(hidden, residual)
        return normed

    def _one_call_plan(self) -> OneCallPlan:
        """The layers' one-call forms, rebuilt where the layer list or the layers up to the first one-call
        layer changed (`OneCallPlan.head`); the caller checks the rest where the step runs one call."""
        if self._one_call is None or not self._one_call.head.current():
            self._one_call = OneCallPlan.of(self)
        return self._one_call

    def _layer_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> LayerCaches:
        """`kv_caches` as the one-call runs read them, kept between steps while they are the same."""
        if self._caches is None or not self._caches.current(kv_caches):
            self._caches = LayerCaches(kv_caches)
        return self._caches

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if layout.size == 1:
            embedded: torch.Tensor = self.embed_tokens(input_ids)
            return embedded
        # Vocabulary-parallel: each rank looks up the ids in its slice, zeros elsewhere; the sum is exact.
        local = input_ids - layout.vocab_start
        outside = (local < 0) | (local >= layout.vocab_end - layout.vocab_start)
        embedded = self.embed_tokens(local.masked_fill(outside, 0))
        return all_reduce_sum(embedded.masked_fill(outside[:, None], 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the rows of `hidden` that need sampling.

        With tensor parallelism every rank must call it with the same rows (the slices are gathered)."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if isinstance(head, QuantizedTensor):
            # float32 straight from the kernel's sums: no bfloat16 rounding of the logits.
            logits: torch.Tensor = quantized_linear(hidden, head, out_dtype=torch.float32)
        elif isinstance(self.lm_head, PrepackedLinear) and self.layout.size == 1:
            # On CPU the engine swapped in a prepacked projection: at a few rows it writes float32 itself.
            return self.lm_head.widened(hidden)
        elif self.lm_head is not None:
            # Through the module: on CPU the engine may have swapped in a prepacked projection.
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        if self.layout.size > 1:
            logits = gather_vocab(logits, self.config.vocab_size, self.layout.size)
        return logits.float()

    @torch.no_grad()
    def zero_vocab_padding(self) -> None:
        """Zero this rank's embedding / LM head rows past the vocabulary (only the last rank has any when N
        does not divide V): no checkpoint tensor fills them, and their logits are dropped."""
        used = self.layout.vocab_end - self.layout.vocab_start
        for weight in (self.embed_tokens.weight, None if self.lm_head is None else self.lm_head.weight):
            if weight is not None:
                weight[used:].zero_()

    def layer_weights(self) -> int:
        """The weights this rank's decoder layers multiply for each token (their projections' in x out
        features, whatever form they are kept in): a prompt token's work, which sets the CPU default of
        how many prompt tokens a step computes while others decode (engine/config.py)."""
        return sum(
            _projection_weights(projection)
            for layer in self.layers
            for projection in cast(DecoderLayer, layer)._parts()[1]
        )

    def weight_tensors(self) -> dict[str, torch.Tensor | QuantizedTensor | Fp8Weight]:
        """Every parameter by name, and the `weight` of each module that keeps it quantized
        (engine/cpu/quantized.py: not a parameter; engine/fp8: the float8 values with their scales)."""
        tensors: dict[str, torch.Tensor | QuantizedTensor | Fp8Weight] = dict(self.named_parameters())
        for name, module in self.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, QuantizedTensor):
                tensors[f"{name}.weight"] = weight
            elif isinstance(module, Fp8Linear):
                tensors[f"{name}.weight"] = module.fp8_weight
                del tensors[f"{name}.weight_scale"]
        return tensors

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every tensor name a Hugging Face checkpoint of this model must hold, and which part of it goes
        where on this rank."""
        params = self.weight_tensors()
        config, layout = self.config, self.layout
        d, hidden = config.head_dim, config.hidden_size
        q_full, kv_full = config.num_attention_heads * d, config.num_key_value_heads * d
        q, kv, inter = layout.heads * d, layout.kv_heads * d, layout.intermediate
        q0, kv0, i0 = layout.first_head * d, layout.first_kv_head * d, layout.first_intermediate
        # checkpoint module -> (our module, rows of it, checkpoint rows, checkpoint output size);
        # q/k/v and gate/up are fused here, and each is split by rows (output features).
        column_parallel = {
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q), slice(q0, q0 + q), q_full),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv), slice(kv0, kv0 + kv), kv_full),
            "self_attn.v_proj": (
                "self_attn.qkv_proj",
                slice(q + kv, q + 2 * kv),
                slice(kv0, kv0 + kv),
                kv_full,
            ),
            "mlp.gate_proj": (
                "mlp.gate_up_proj",
                slice(0, inter),
                slice(i0, i0 + inter),
                config.intermediate_size,
            ),
            "mlp.up_proj": (
                "mlp.gate_up_proj",
                slice(inter, 2 * inter),
                slice(i0, i0 + inter),
                config.intermediate_size,
            ),
        }
        # Split by columns (input features): o_proj by head, down_proj by intermediate row.
        row_parallel = {
            "self_attn.o_proj": (slice(q0, q0 + q), q_full),
            "mlp.down_proj": (slice(i0, i0 + inter), config.intermediate_size),
        }
        targets: dict[str, WeightTarget] = {}
        vocab_rows = slice(0, layout.vocab_end - layout.vocab_start)
        vocab_source = (slice(layout.vocab_start, layout.vocab_end),)
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in params:
                hf_name = name if name.startswith("lm_head.") else f"model.{name}"
                shape = (config.vocab_size, hidden)
                targets[hf_name] = WeightTarget(params[name], shape, vocab_rows, vocab_source)
        targets["model.norm.weight"] = WeightTarget(params["norm.weight"], (hidden,))
        for i in range(config.num_hidden_layers):
            layer = f"layers.{i}"
            for hf_module, (module, rows, source, out_size) in column_parallel.items():
                targets[f"model.{layer}.{hf_module}.weight"] = WeightTarget(
                    params[f"{layer}.{module}.weight"], (out_size, hidden), rows, (source,)
                )
                if f"{layer}.{module}.bias" in params:
                    targets[f"model.{layer}.{hf_module}.bias"] = WeightTarget(
                        params[f"{layer}.{module}.bias"], (out_size,), rows, (source,)
                    )
            for hf_module, (source, in_size) in row_parallel.items():
                targets[f"model.{layer}.{hf_module}.weight"] = WeightTarget(
                    params[f"{layer}.{hf_module}.weight"], (hidden, in_size), None, (slice(None), source)
                )
            if config.o_proj_bias:
                bias = params.get(f"{layer}.self_attn.o_proj.bias")
                targets[f"model.{layer}.self_attn.o_proj.bias"] = WeightTarget(bias, (hidden,))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                targets[f"model.{layer}.{norm}.weight"] = WeightTarget(
                    params[f"{layer}.{norm}.weight"], (hidden,)
                )
        return targets
