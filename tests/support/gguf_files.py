"""Checkpoint folders written as GGUF files the way llama.cpp's converter writes them (tensor names, q/k
row permutation for llama/mistral, Llama 3.1 rope factors as rope_freqs.weight), optionally quantized."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf import quants as gguf_quants
from safetensors.torch import load_file

from inflight.engine.gguf.checkpoint import GGUF_ARCHITECTURES

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama3_rope_factors(raw: dict, head_dim: int) -> list[float]:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3."""
    scaling = raw["rope_scaling"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * raw["rope_theta"] ** (i / head_dim)
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _add_tokenizer(writer: GGUFWriter, model_dir: Path) -> None:
    """The checkpoint's byte-level BPE tokenizer as tokenizer.ggml.* metadata (added tokens as control)."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    added = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    config = json.loads((model_dir / "config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in added else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def write_gguf(
    model_dir: Path, out: Path, quantize: GGMLQuantizationType | None = None, tokenizer: bool = False
) -> Path:
    """A GGUF of `model_dir`'s config and weights (F32, or 2-D weights in `quantize`), and its tokenizer
    if asked."""
    raw = json.loads((model_dir / "config.json").read_text())
    arch = {hf: gguf for gguf, hf in GGUF_ARCHITECTURES.items()}[raw["architectures"][0]]
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(raw["rope_theta"])
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    writer.add_vocab_size(raw["vocab_size"])
    if raw.get("sliding_window") and arch == "mistral":
        writer.add_sliding_window(raw["sliding_window"])
    if (raw.get("rope_scaling") or {}).get("rope_type") == "llama3":
        factors = torch.tensor(_llama3_rope_factors(raw, head_dim), dtype=torch.float32)
        writer.add_tensor("rope_freqs.weight", factors.numpy())
    if tokenizer:
        _add_tokenizer(writer, model_dir)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name in HF_TO_GGUF:
            gguf_name = HF_TO_GGUF[name]
        else:
            _, _, layer, *module, kind = name.split(".")
            gguf_name = f"blk.{layer}.{LAYER_TO_GGUF['.'.join(module)]}.{kind}"
        if arch != "qwen2" and ".attn_q." in gguf_name:
            tensor = _permute(tensor, heads)
        elif arch != "qwen2" and ".attn_k." in gguf_name:
            tensor = _permute(tensor, kv_heads)
        data = tensor.float().numpy()
        if quantize is not None and data.ndim == 2:
            writer.add_tensor(gguf_name, gguf_quants.quantize(data, quantize), raw_dtype=quantize)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
