"""`inflight make-model` writes a deterministic, transformers-loadable checkpoint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from inflight.checkpoints.make import PRESETS, make_model
from inflight.cli import main
from inflight.engine.model.config import ModelConfig

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def _hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    again = make_model(tmp_path / "again", preset="tiny", arch="llama", seed=0, progress=lambda _: None)
    assert sorted(_hashes(again)) == FILES
    assert _hashes(again) == _hashes(tiny_llama_dir)

    assert main(["make-model", "--out", str(tmp_path / "seed1"), "--seed", "1"]) == 0
    seed1 = _hashes(tmp_path / "seed1")
    for name, digest in _hashes(tiny_llama_dir).items():
        assert (seed1[name] == digest) == (name != "model.safetensors"), name
    progress = capsys.readouterr().err.splitlines()
    assert any("training a byte-level BPE tokenizer" in line for line in progress)
    assert any("1,262,720 parameters" in line for line in progress)
    assert progress[-1] == f"make-model: done: {(tmp_path / 'seed1').resolve()}"


def test_refuses_to_overwrite_without_force(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["make-model", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("arch", "hf_class"),
    [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("mistral", "MistralForCausalLM")],
)
def test_transformers_loads_it_with_the_intended_features(request, arch: str, hf_class: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == hf_class
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= num_params <= 3_000_000
    AutoTokenizer.from_pretrained(model_dir)

    config = ModelConfig.from_dir(model_dir)
    assert config.architecture == hf_class
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    if arch == "llama":
        assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
        assert model.config.rope_parameters["rope_type"] == "llama3"
    if arch == "qwen2":
        assert config.attention_bias and config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if arch == "mistral":
        assert config.sliding_window == PRESETS["tiny"].sliding_window
    # Random but not degenerate: the logits vary across the vocabulary.
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.std() > 0.05


def test_files_carry_tokens_and_template(tiny_llama_dir: Path) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    tokenizer_config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["vocab_size"] == PRESETS["tiny"].vocab_size
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token_id"] in generation["eos_token_id"]


def test_llama_1b_preset_has_llama_3_2_1b_shape() -> None:
    """Its config and tensors (without writing 2.5 GB): Llama-3.2-1B's shape, tied embeddings, 1.24 B."""
    from inflight.checkpoints.make import BOS, EOS, PAD, _count_params, _hf_config, _tensor_shapes

    spec = PRESETS["llama-1b"]
    config = _hf_config(spec, "llama", spec.vocab_size, {BOS: 1, EOS: 2, PAD: 0})
    shape = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    assert shape == {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32}
    assert (config["num_key_value_heads"], config["intermediate_size"]) == (8, 8192)
    assert config["vocab_size"] == 128256 and config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"
    assert "lm_head.weight" not in dict(_tensor_shapes(spec, "llama", 128256))
    assert _count_params(spec, "llama", 128256) == 1_235_814_400
