"""load_model reads config.json + safetensors itself and names the file and the problem when it cannot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.engine.loader import load_model
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.errors import ModelLoadError


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, out)
    return out


def _edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _load_error(model_dir: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir)
    return str(info.value)


def test_unsupported_architecture_names_config_and_supported_ones(model_copy: Path) -> None:
    _edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    message = _load_error(model_copy)
    assert str(model_copy / "config.json") in message
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message


def test_unsupported_rope_scaling_is_rejected(model_copy: Path) -> None:
    _edit_config(model_copy, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert "'yarn' is not supported" in _load_error(model_copy)


def test_heads_not_divisible_by_kv_heads_is_rejected(model_copy: Path) -> None:
    _edit_config(model_copy, num_key_value_heads=3)
    assert "not a multiple of num_key_value_heads" in _load_error(model_copy)


def test_missing_config(model_copy: Path) -> None:
    (model_copy / "config.json").unlink()
    message = _load_error(model_copy)
    assert str(model_copy / "config.json") in message and "make-model" in message


def test_config_that_is_not_json(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    assert "not valid JSON" in _load_error(model_copy)


def test_missing_directory(tmp_path: Path) -> None:
    assert "not a directory" in _load_error(tmp_path / "nowhere")


def test_no_weights(model_copy: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    assert "no model.safetensors" in _load_error(model_copy)
    (model_copy / "pytorch_model.bin").write_bytes(b"pickle")
    assert "pytorch_model.bin" in _load_error(model_copy)


def test_truncated_weights(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = _load_error(model_copy)
    assert str(weights) in message and "corrupt or truncated" in message


def test_garbage_weights(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    weights.write_bytes(b"\x00\x01garbage" * 10)
    assert str(weights) in _load_error(model_copy)


def test_missing_tensor_is_named(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, weights)
    message = _load_error(model_copy)
    assert "model.layers.2.mlp.up_proj.weight" in message and str(weights) in message


def test_misshaped_tensor_is_named_with_both_shapes(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 128)
    save_file(tensors, weights)
    message = _load_error(model_copy)
    assert "model.layers.1.self_attn.k_proj.weight" in message
    assert "(32, 128)" in message and "(64, 128)" in message and str(weights) in message


def test_unexpected_tensor_is_named(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)
    save_file(tensors, weights)
    assert "model.layers.0.self_attn.q_norm.weight" in _load_error(model_copy)


def _shard(model_dir: Path) -> dict[str, torch.Tensor]:
    single = model_dir / "model.safetensors"
    tensors = load_file(single)
    single.unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, model_dir / file)
        weight_map.update(dict.fromkeys(shard_names, file))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def test_sharded_checkpoint_loads_the_same_weights(model_copy: Path, tiny_llama_dir: Path) -> None:
    _shard(model_copy)
    sharded = load_model(model_copy)
    single = load_model(tiny_llama_dir)
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_index_naming_a_missing_shard(model_copy: Path) -> None:
    _shard(model_copy)
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    message = _load_error(model_copy)
    assert "model-00002-of-00002.safetensors" in message and "model.safetensors.index.json" in message


def test_config_saved_by_transformers_5_parses_the_same(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """transformers 5 rewrites rope_theta/rope_scaling as `rope_parameters`; both layouts parse alike."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path)
    ours = ModelConfig.from_dir(tiny_llama_dir)
    assert ours.rope_scaling is not None and ours.rope_scaling.rope_type == "llama3"
    assert ModelConfig.from_dir(tmp_path) == ours


def test_dtype_by_name_and_unsupported_dtype(tiny_qwen2_dir: Path) -> None:
    assert load_model(tiny_qwen2_dir, dtype="bfloat16").embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="int8 is not supported"):
        load_model(tiny_qwen2_dir, dtype="int8")
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(tiny_qwen2_dir, dtype=torch.float64)
