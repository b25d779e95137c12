"""Each architecture the engine runs, written as a GGUF file the way llama.cpp's converter writes it
(tensor names, q/k row permutation for llama/mistral, Llama 3.1 rope factors as rope_freqs.weight),
loads to the same config and the same logits as its Hugging Face checkpoint folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf import quants as gguf_quants
from safetensors.torch import load_file

from inflight.engine.gguf.checkpoint import GGUF_ARCHITECTURES
from inflight.engine.loader import load_model
from inflight.engine.model.config import ModelConfig

from support.paged_model import paged_logits

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


PROMPT = [5, 77, 300, 12, 901, 4, 64, 1000, 33, 2, 150, 7, 8, 9, 1999, 40, 41, 42, 43, 44, 45, 46, 47]
CHUNKS = [PROMPT[:17], PROMPT[17:20], *([t] for t in PROMPT[20:])]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_gguf_loads_like_its_checkpoint_folder(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    gguf = write_gguf(model_dir, tmp_path / f"{arch}.gguf")
    expected_config = ModelConfig.from_dir(model_dir)
    ours = load_model(gguf)
    # Token ids are the tokenizer's business in a GGUF; eps and theta are stored as float32 there.
    ignored = {"bos_token_id", "eos_token_id", "torch_dtype", "rms_norm_eps", "rope_theta"}
    assert ours.config.model_dump(exclude=ignored) == expected_config.model_dump(exclude=ignored)
    assert ours.config.rms_norm_eps == pytest.approx(expected_config.rms_norm_eps, rel=1e-7)
    assert ours.config.rope_theta == pytest.approx(expected_config.rope_theta, rel=1e-7)
    reference = load_model(model_dir)
    torch.testing.assert_close(paged_logits(ours, CHUNKS), paged_logits(reference, CHUNKS), atol=1e-5, rtol=0)


def test_a_q8_0_gguf_runs_on_its_dequantized_weights(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    ours = load_model(write_gguf(tiny_qwen2_dir, tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0))
    reference = load_model(tiny_qwen2_dir)
    delta = paged_logits(ours, CHUNKS) - paged_logits(reference, CHUNKS)
    assert 0 < delta.abs().max().item() < 0.05  # quantization noise, not a wrong layout


def test_two_tensor_parallel_ranks_run_a_gguf_like_one_rank_runs_its_folder(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from inflight.engine.config import EngineConfig
    from inflight.engine.engine import LLMEngine
    from inflight.engine.sequence import SamplingParams

    gguf = write_gguf(tiny_llama_dir, tmp_path / "llama.gguf", tokenizer=True)
    prompts = [PROMPT, PROMPT[3:11], [9, 8, 7, 6, 5]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(model: Path, tp: int) -> list[list[int]]:
        config = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=32, tensor_parallel_size=tp)
        engine = LLMEngine(model, config)
        try:
            return [output.outputs[0].token_ids for output in engine.generate(prompts, params)]
        finally:
            engine.close()

    assert run(gguf, 2) == run(tiny_llama_dir, 1)
