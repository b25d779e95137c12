"""A Llama-family decoder (Llama, Qwen2, Mistral) whose attention reads and writes a paged KV cache.

The batch is flattened (see attention/metadata.py): `input_ids` and `positions` are [T] for all the
step's new tokens. q/k/v and gate/up projections are fused into one matmul each; the loader maps the
checkpoint's separate tensors into their row ranges (`weight_targets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from inflight.engine.attention.backend import AttentionBackend
from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.model import ops
from inflight.engine.model.config import ModelConfig


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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
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
            self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim, cos, sin
        )
        self.backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if keep is not None:
            rows, meta = keep
            q = q[rows]
        out = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(q.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

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
        normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(rope, normed, k_cache, v_cache, meta, keep)
        if keep is not None:
            residual = residual[keep[0]]
        normed, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(normed), residual


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes: rows `rows` of `param` (the whole parameter when rows is None)."""

    param: torch.Tensor
    rows: slice | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.rows is None:
            return tuple(self.param.shape)
        return (self.rows.stop - self.rows.start, *self.param.shape[1:])


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral decoder over a paged KV cache.

    The model lives on the device it was built for (the rotary tables are created there).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config, device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

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
        hidden = self.embed_tokens(input_ids)
        rope = ops.rotary_tables(*self.rotary(positions), like=hidden)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            layer_keep = keep if i == last else None
            hidden, residual = layer(rope, hidden, residual, k_cache, v_cache, attn_metadata, layer_keep)
        normed, _ = self.norm(hidden, residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the rows of `hidden` that need sampling."""
        if self.lm_head is not None:
            # Through the module: on CPU the engine may have swapped in a prepacked projection.
            logits: torch.Tensor = self.lm_head(hidden)
            return logits.float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every tensor name a Hugging Face checkpoint of this model must hold, and where it goes."""
        params = dict(self.named_parameters())
        config = self.config
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        # checkpoint name -> (our parameter, rows of it); q/k/v and gate/up are fused here.
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
            "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
            "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
            "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
        }
        targets: dict[str, WeightTarget] = {}
        for name, param in params.items():
            if not name.startswith("layers."):
                hf_name = name if name.startswith("lm_head.") else f"model.{name}"
                targets[hf_name] = WeightTarget(param)
        for i in range(config.num_hidden_layers):
            layer = f"layers.{i}"
            for hf_module, (module, rows) in fused.items():
                for kind in ("weight", "bias"):
                    if f"{layer}.{module}.{kind}" in params:
                        param = params[f"{layer}.{module}.{kind}"]
                        targets[f"model.{layer}.{hf_module}.{kind}"] = WeightTarget(param, rows)
            for module in (
                "self_attn.o_proj",
                "mlp.down_proj",
                "input_layernorm",
                "post_attention_layernorm",
            ):
                for kind in ("weight", "bias"):
                    if f"{layer}.{module}.{kind}" in params:
                        targets[f"model.{layer}.{module}.{kind}"] = WeightTarget(
                            params[f"{layer}.{module}.{kind}"]
                        )
        return targets


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one layer's K (or V) cache: [num_blocks, block_size, num_kv_heads, head_dim]."""
    return (num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (K, V) cache pairs, one per layer."""
    shape = kv_cache_shape(config, num_blocks, block_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]
