"""bench --model with a GGUF file: the exported Hugging Face folder every system reads holds the same
weights and tokenizer as the GGUF inflight serves (real component: the SmolLM2 GGUF, transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inflight.bench.checkpoint import export_gguf
from inflight.engine.loader import load_model
from inflight.engine.tokenizer import Tokenizer


def test_exported_folder_equals_the_gguf(smollm2_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "smollm2-hf"
    export_gguf(smollm2_gguf, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]  # for vLLM's older reader
    from_gguf = load_model(smollm2_gguf, quantization="none").state_dict()  # the export dequantizes
    from_folder = load_model(out).state_dict()
    assert from_gguf.keys() == from_folder.keys()
    for name, tensor in from_gguf.items():
        assert torch.equal(tensor, from_folder[name]), name
    text = "Hello, world! 1234 <|im_start|>user\nnaïve café"
    assert Tokenizer.from_path(out).encode(text) == Tokenizer.from_path(smollm2_gguf).encode(text)
