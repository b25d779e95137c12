"""GGUF files the engine cannot run fail at load with a message naming what is unsupported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from inflight.engine.gguf.checkpoint import GGUFCheckpoint, unpermute_rows
from inflight.engine.loader import load_model
from inflight.engine.model.errors import ModelLoadError


def _write(
    path: Path,
    arch: str,
    extra: dict[str, int] | None = None,
    tensors: tuple[str, ...] = (),
    raw_tensor: tuple[str, np.ndarray, GGMLQuantizationType] | None = None,
) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(32)
    for key, value in (extra or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name in tensors:
        writer.add_tensor(name, np.zeros((4, 32), dtype=np.float32))
    if raw_tensor is not None:
        name, raw, kind = raw_tensor
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "gemma2")
    with pytest.raises(ModelLoadError, match=r"m\.gguf: GGUF architecture 'gemma2' is not supported.*llama"):
        load_model(path)


def test_a_mixture_of_experts_file_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "mixtral.gguf", "llama", {"expert_count": 8})
    with pytest.raises(ModelLoadError, match=r"mixture-of-experts model \(llama\.expert_count=8\)"):
        load_model(path)


def test_an_unsupported_tensor_type_is_named_before_the_model_is_built(tmp_path: Path) -> None:
    q8_k = GGMLQuantizationType.Q8_K
    raw = np.zeros((4, GGML_QUANT_SIZES[q8_k][1]), dtype=np.uint8)
    _write(tmp_path / "m.gguf", "llama", raw_tensor=("blk.0.ffn_up.weight", raw, q8_k))
    with pytest.raises(ModelLoadError, match=r"m\.gguf: GGUF tensor type\(s\) Q8_K not supported; .*Q4_K"):
        GGUFCheckpoint(tmp_path / "m.gguf").config()


def test_tensors_without_a_place_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "llama", tensors=("blk.0.ffn_gate_inp.weight",))
    checkpoint = GGUFCheckpoint(path)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate_inp\.weight have no place"):
        next(checkpoint.tensors(checkpoint.config(), torch.float32))


def test_a_file_without_a_vocabulary_size_is_refused(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_embedding_length(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"m\.gguf: metadata lacks"):
        load_model(tmp_path / "m.gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"broken\.gguf: not a readable GGUF file"):
        load_model(path)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    """llama.cpp's convert_hf_to_gguf.py permutes q/k rows like this; we must restore HF's order."""
    heads, head_dim, cols = 3, 8, 5
    hf = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    stored = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not torch.equal(stored, hf)
    assert torch.equal(unpermute_rows(stored, heads), hf)
