"""The tokenizer a GGUF file describes (tokenizer.ggml.* metadata), built with the `tokenizers` library.

Both kinds llama.cpp writes for the Llama family are rebuilt the way transformers' GGUF loader builds
them, so ids and text are the same as with `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
(tests/engine/gguf/test_gguf_tokenizer.py):
- byte-level BPE (`tokenizer.ggml.model` = gpt2: Llama 3, Qwen2, SmolLM, ...): the vocabulary and
  merges from the file, the pre-tokenizer split that `tokenizer.ggml.pre` names;
- SentencePiece BPE (`llama`: Llama 2, Mistral 7B, ...): the vocabulary with byte fallback, merges from
  the file or derived from the token scores, a "▁" word-boundary prefix;
and in both, control tokens as special tokens and user-defined ones as added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from inflight.engine.gguf.checkpoint import GGUFCheckpoint

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp's token types
SPIECE_SPACE = "\u2581"

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


def _merges_from_scores(
    vocab: dict[str, int], scores: list[float], tokens: list[str]
) -> list[tuple[str, str]]:
    """SentencePiece keeps no merges: every split of a token into two vocabulary pieces, best-scored
    token first (transformers' `generate_merges` order)."""
    merges: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_bpe(checkpoint: GGUFCheckpoint, tokens: list[str], types: list[int]) -> HFTokenizer:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges_raw = checkpoint.array("tokenizer.ggml.merges")
    if merges_raw is not None:
        merges = [tuple(merge.split(" ", 1)) for merge in merges_raw]
    else:
        scores = checkpoint.array("tokenizer.ggml.scores")
        if scores is None:
            raise checkpoint.fail(
                "neither tokenizer.ggml.merges nor tokenizer.ggml.scores; cannot build BPE."
            )
        merges = _merges_from_scores(vocab, [float(s) for s in scores], tokens)
    tokenizer = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = checkpoint.metadata.get("tokenizer.ggml.add_space_prefix") is not False
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, types, strict=True)
            if kind in (UNKNOWN, CONTROL)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED
        ]
    )
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


@dataclass(frozen=True)
class GGUFTokenizer:
    """What engine/tokenizer.py's Tokenizer is built from: the fast tokenizer, its special tokens
    (tokenizer_config.json's keys), further end-of-generation ids and the chat template."""

    tokenizer: HFTokenizer
    config: dict[str, Any]
    extra_eos_ids: list[int]
    chat_template: str | None


def tokenizer_from_gguf(checkpoint: GGUFCheckpoint) -> GGUFTokenizer:
    """The tokenizer (ids, text, special tokens, chat template) of the file's tokenizer.ggml.* metadata."""
    meta = checkpoint.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = checkpoint.array("tokenizer.ggml.tokens")
    if tokens is None:
        raise checkpoint.fail("tokenizer.ggml.tokens is missing; the file carries no tokenizer.")
    if kind not in ("gpt2", "llama"):
        raise checkpoint.fail(
            f"tokenizer.ggml.model {kind!r} is not supported; inflight builds byte-level BPE ('gpt2') and "
            "SentencePiece BPE ('llama') tokenizers. Load the Hugging Face checkpoint instead."
        )
    types = [int(t) for t in checkpoint.array("tokenizer.ggml.token_type") or [1] * len(tokens)]
    token_list = [str(t) for t in tokens]
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(checkpoint, token_list, types)
    else:
        tokenizer = _sentencepiece_bpe(checkpoint, token_list, types)

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
        # SentencePiece vocabularies that do not say otherwise get BOS (as llama.cpp and transformers do).
        bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    # llama.cpp stops at every end-of-generation token the file names, not only at EOS.
    extra_eos = [
        int(meta[f"tokenizer.ggml.{key}"])
        for key in ("eot_token_id", "eom_token_id")
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int)
    ]
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(tokenizer, config, extra_eos, template if isinstance(template, str) else None)
