"""The tokenizer a GGUF file describes (tokenizer.ggml.* metadata), built with the `tokenizers` library.

Byte-level BPE vocabularies (`tokenizer.ggml.model` = gpt2: Llama 3, Qwen2, SmolLM, ...) are rebuilt the
way transformers' GGUF loader builds them, so ids and text are the same as with
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` (tests/gguf/test_gguf_vs_transformers.py): the
vocabulary and merges from the file, the pre-tokenizer split that `tokenizer.ggml.pre` names, control
tokens as special tokens and user-defined ones as added tokens.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from inflight.engine.gguf.checkpoint import GGUFCheckpoint
from inflight.engine.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split its merges were learned on; other names get GPT-2's own split.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (as in tokenizers' ByteLevel)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_spelling(token: str, alphabet: set[str]) -> str:
    """A vocabulary entry in the byte alphabet (llama.cpp writes some added tokens as plain text)."""
    if set(token) <= alphabet:
        return token
    spelling = _byte_alphabet()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _byte_level_bpe(checkpoint: GGUFCheckpoint, tokens: list[str], types: list[int]) -> HFTokenizer:
    alphabet = set(_byte_alphabet().values())
    vocab = {_byte_level_spelling(token, alphabet): index for index, token in enumerate(tokens)}
    merges_raw = checkpoint.array("tokenizer.ggml.merges")
    if merges_raw is None:
        raise checkpoint.fail(
            "tokenizer.ggml.merges is missing; a byte-level BPE vocabulary needs its merges."
        )
    merges = [tuple(merge.split(" ", 1)) for merge in merges_raw]
    tokenizer = HFTokenizer(
        BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = PRE_TOKENIZER_SPLITS.get(str(checkpoint.metadata.get("tokenizer.ggml.pre")))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types, strict=True)
        if kind == CONTROL and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(control)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind == USER_DEFINED and token in vocab
    ]
    tokenizer.add_tokens(user_defined)
    return tokenizer


def _special_processor(
    tokenizer: HFTokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool
) -> None:
    """BOS/EOS added around every encoded text when the file asks for it (tokenizer.ggml.add_*_token)."""
    first = [bos] if add_bos and bos is not None else []
    last = [eos] if add_eos and eos is not None else []
    if not first and not last:
        return
    specials = [(t, tokenizer.token_to_id(t)) for t in {*first, *last}]
    single = " ".join([*first, "$A", *last])
    pair = " ".join([*first, "$A", *last, *first, "$B:1", *last])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def tokenizer_from_gguf(checkpoint: GGUFCheckpoint) -> Tokenizer:
    """Our Tokenizer (ids, text, special tokens, chat template) for the file's tokenizer.ggml.* metadata."""
    meta = checkpoint.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = checkpoint.array("tokenizer.ggml.tokens")
    if tokens is None:
        raise checkpoint.fail("tokenizer.ggml.tokens is missing; the file carries no tokenizer.")
    if kind != "gpt2":
        raise checkpoint.fail(
            f"tokenizer.ggml.model {kind!r} is not supported; inflight builds byte-level BPE ('gpt2') "
            "tokenizers from GGUF files (Llama 3, Qwen2, SmolLM). Load the Hugging Face checkpoint instead."
        )
    types = checkpoint.array("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer = _byte_level_bpe(checkpoint, [str(t) for t in tokens], [int(t) for t in types])

    def token_of(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return str(tokens[index]) if isinstance(index, int) and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "pad_token": token_of("padding_token_id"),
        "unk_token": token_of("unknown_token_id"),
    }
    _special_processor(
        tokenizer,
        config["bos_token"],
        config["eos_token"],
        bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    # llama.cpp stops at every end-of-generation token the file names, not only at EOS.
    extra_eos = [
        int(meta[f"tokenizer.ggml.{key}"])
        for key in ("eot_token_id", "eom_token_id")
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int)
    ]
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(tokenizer, config, extra_eos, template if isinstance(template, str) else None)
