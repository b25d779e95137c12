"""Our tokenizer (tokenizers + tokenizer_config.json, no transformers) agrees with transformers'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inflight.checkpoints.make import EOS, IM_END
from inflight.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = [
    "Hello world",
    "  leading spaces\n\n\ttabs and trailing   ",
    "héllo ünïcode — 日本語のテキスト 🚀🎉 Ωμέγα",
    "Cafe\u0301 vs Café: don't, I'LL, we've 1234567",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(params=ARCHS)
def model_dir(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(f"tiny_{request.param}_dir")
    return path


def test_encode_and_decode_equal_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens([5, 100]) == theirs.convert_ids_to_tokens([5, 100])
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id


def test_special_tokens_and_stop_ids(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = Tokenizer.from_dir(tiny_llama_dir)
    assert llama.encode("hi")[0] == llama.bos_token_id
    assert llama.decode(llama.encode("hi")) == "hi"
    # Chat turns end with <|im_end|>: generation_config.json lists it next to the tokenizer's eos.
    end_ids = llama.encode(EOS + IM_END, add_special_tokens=False)
    assert llama.all_eos_ids == frozenset(end_ids)
    assert llama.eos_token_id == end_ids[0]
    qwen2 = Tokenizer.from_dir(tiny_qwen2_dir)
    assert qwen2.bos_token_id is None
    assert qwen2.encode("hi") == qwen2.encode("hi", add_special_tokens=False)


def test_chat_template_equals_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi 🚀"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    for generation_prompt in (True, False):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        expected = theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert rendered == expected
    assert ours.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


def test_model_without_chat_template_fails_clearly(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config_path = tmp_path / "m" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path / "m")
    assert tokenizer.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_incremental_detokenizer_never_emits_half_characters(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    text = "naïve 日本語 🚀🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The emoji are rare in the training text, so they are split into several byte tokens.
    assert len(tokenizer.encode("🚀", add_special_tokens=False)) > 1
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(token) for token in ids]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete


def test_incremental_detokenizer_continues_a_prompt(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    prompt = tokenizer.encode("The answer is")
    generated = tokenizer.encode(" forty-two, surely.", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert eos is not None
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    streamed = "".join(detok.add(t) for t in [*generated, eos])
    assert streamed == " forty-two, surely."  # the leading space survives; the special token is skipped


def test_incremental_detokenizer_flush_releases_an_incomplete_character(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    rocket = tokenizer.encode("🚀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(tokenizer.encode("ok", add_special_tokens=False)[0]) == "ok"
    assert [detok.add(t) for t in rocket[:-1]] == [""] * (len(rocket) - 1)
    assert detok.flush() == "\ufffd"
