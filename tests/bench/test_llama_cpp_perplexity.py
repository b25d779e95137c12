"""benchmarks/llama_cpp_perplexity.py's reading of llama.cpp's output and its chunking (llama-perplexity's
method), and benchmarks/gguf_q8_0.py's requantization. The llama.cpp build itself is not run here."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def perplexity(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.llama_cpp_perplexity")


@pytest.fixture
def q8_0(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.gguf_q8_0")


def test_final_perplexity_is_read_from_the_log(perplexity: ModuleType) -> None:
    log = (
        "perplexity: calculating perplexity over 40 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
        "[1]17.1234,[2]18.0000,\n"
        "Final estimate: PPL = 18.4321 +/- 0.41234\n"
    )
    assert perplexity.final_perplexity(log) == 18.4321
    with pytest.raises(RuntimeError, match="no final estimate"):
        perplexity.final_perplexity("perplexity: failed to decode\n")


def test_token_ids_are_read_from_llama_tokenize(perplexity: ModuleType) -> None:
    assert perplexity.token_ids("[1, 504, 29871]\n") == [1, 504, 29871]
    assert perplexity.token_ids("[]") == []
    with pytest.raises(RuntimeError, match="no id list"):
        perplexity.token_ids("error: failed to load model\n")


def test_chunks_match_llama_perplexity(perplexity: ModuleType) -> None:
    ids = list(range(100, 111))
    assert perplexity.chunks(ids, 4, 2, bos=1) == [[1, 101, 102, 103], [1, 105, 106, 107]]
    assert perplexity.chunks(ids, 4, 2, bos=None) == [[100, 101, 102, 103], [104, 105, 106, 107]]
    with pytest.raises(ValueError, match="fewer than 3 chunks of 4"):
        perplexity.chunks(ids, 4, 3, bos=None)


def test_the_second_half_of_each_chunk_is_scored(perplexity: ModuleType) -> None:
    # perplexity.cpp: first = n_ctx/2, logits from `first` score n_ctx - 1 - first tokens.
    for ctx in (512, 513, 1024):
        first = ctx // 2
        assert ctx - perplexity.first_scored(ctx) == ctx - 1 - first


def test_q8_0_requantizes_the_same_weights(q8_0: ModuleType) -> None:
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    q4_1 = quantize(weights, GGMLQuantizationType.Q4_1)
    data, qtype = q8_0.converted_tensor(q4_1, GGMLQuantizationType.Q4_1)
    assert qtype == GGMLQuantizationType.Q8_0
    source = dequantize(q4_1, GGMLQuantizationType.Q4_1)
    requantized = dequantize(data, GGMLQuantizationType.Q8_0)
    # Within half an 8-bit step of each 32-weight block (scale max|w|/127), plus the scale's float16
    # rounding (a relative 2**-11) times the largest level, 127.
    step = np.abs(source.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    error = np.abs(requantized - source).reshape(-1, 32)
    assert np.all(error <= step * (0.5 + 127 * 2**-11))
    norms = rng.standard_normal(64).astype(np.float32)
    kept, kept_type = q8_0.converted_tensor(norms, GGMLQuantizationType.F32)
    assert kept_type == GGMLQuantizationType.F32 and np.array_equal(kept, norms)
