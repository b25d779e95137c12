"""Tokenizer of a Hugging Face checkpoint folder, from tokenizer.json via the `tokenizers` library.

No transformers at runtime: special tokens and the chat template come from tokenizer_config.json,
extra end-of-sequence ids from generation_config.json and config.json.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"
LONG_TEXT = 16_384  # characters; longer texts are tokenized without holding the GIL (see `_encoding`)


class TokenizerError(Exception):
    """The tokenizer files are missing or unusable, or a request needs something they do not have."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e}); restore the file from the checkpoint.") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _text(message: Mapping[str, Any]) -> str:
    """A chat message's text content ("" for none, e.g. an assistant turn of tool calls only)."""
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _compile_chat_template(source: str) -> Template:
    """Compile a chat template the way Hugging Face renders them (same environment, filters, globals)."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"the model's chat template does not compile: {e}") from e


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        tokenizer_config: dict[str, Any],
        extra_eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = _token_content(tokenizer_config.get("bos_token"))
        self.eos_token = _token_content(tokenizer_config.get("eos_token"))
        self.pad_token = _token_content(tokenizer_config.get("pad_token"))
        self.unk_token = _token_content(tokenizer_config.get("unk_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        eos_ids = [] if self.eos_token_id is None else [self.eos_token_id]
        self.all_eos_ids: frozenset[int] = frozenset([*eos_ids, *extra_eos_ids])
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._compiled_template: Template | None = None
        special = {
            token.content: token_id
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special and token.content
        }
        self._special_ids = frozenset(special.values())
        self._special_text = (
            re.compile("|".join(re.escape(text) for text in sorted(special, key=len, reverse=True)))
            if special
            else None
        )
        self._plain: HFTokenizer | None = None  # a copy that reads special-token text as plain text

    def vocabulary(self) -> dict[str, int]:
        """Every token's text -> id, added tokens included."""
        vocab: dict[str, int] = self._tokenizer.get_vocab(with_added_tokens=True)
        return vocab

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @classmethod
    def from_path(cls, model: str | Path) -> Tokenizer:
        """The tokenizer of a checkpoint folder, or the one a GGUF file's metadata describes."""
        from inflight.engine.gguf import is_gguf

        if is_gguf(model):
            from inflight.engine.gguf.checkpoint import open_checkpoint
            from inflight.engine.gguf.tokenizer import tokenizer_from_gguf

            parts = tokenizer_from_gguf(open_checkpoint(model))
            return cls(parts.tokenizer, parts.config, parts.extra_eos_ids, parts.chat_template)
        return cls.from_dir(model)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"{path}: not found. inflight needs a fast tokenizer (tokenizer.json); save one with "
                "transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(DIR)`."
            )
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise TokenizerError(f"{path}: cannot load tokenizer ({e}); restore the file.") from e
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        extra_eos = [
            *_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
            *_ids(_read_json(model_dir / "config.json").get("eos_token_id")),
        ]
        template = tokenizer_config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, tokenizer_config, extra_eos, template if isinstance(template, str) else None)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar libraries build their own from)."""
        text: str = self._tokenizer.to_str()
        return text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._encoding(text, add_special_tokens).ids
        return ids

    def _encoding(self, text: str, add_special_tokens: bool) -> Encoding:
        # The batch call gives up the GIL while it works, the single one does not: a long text
        # tokenized in a worker thread would otherwise stall the server's event loop for seconds.
        if len(text) < LONG_TEXT:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        encoding: Encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return encoding

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) < LONG_TEXT // 4:
            text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
            return text
        texts: list[str] = self._tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)
        return texts[0]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the checkpoint's chat template (a sandboxed Jinja environment).

        `variables`: more template variables (e.g. `tools`, a request's chat_template_kwargs); they cannot
        replace the messages or the special tokens. `continue_final_message`: the text ends with the last
        message's content, open for the model to continue (no end-of-turn after it, no new turn)."""
        if self.chat_template is None:
            raise TokenizerError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json and no "
                "chat_template.jinja); send a plain completion prompt instead."
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        fixed = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
        }
        rendered: str = self._compiled_template.render({**(variables or {}), **fixed})
        if continue_final_message:
            final = _text(messages[-1]) if messages else ""
            end = rendered.rfind(final) if final else -1
            if end < 0:
                raise TokenizerError(
                    "continue_final_message needs a last message with text content that the chat template "
                    "renders unchanged"
                )
            rendered = rendered[: end + len(final)]
        return rendered

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat where only the template makes control tokens: special-token text
        inside a message (e.g. a user writing "<|im_start|>system") is encoded as plain text, so a
        message cannot forge a turn. Benign messages tokenize exactly as the rendered text does."""

        def render(chat: list[dict[str, Any]]) -> str:
            return self.apply_chat_template(chat, add_generation_prompt, continue_final_message, variables)

        if self._special_text is None or not any(self._special_text.search(_text(m)) for m in messages):
            return self.encode(render(messages), False)
        special_text = self._special_text
        nonce = uuid.uuid4().hex
        forged: list[str] = []

        def mark(match: re.Match[str]) -> str:
            forged.append(match.group())
            return f"\ue000{nonce}:{len(forged) - 1}\ue001"

        marked = [{**m, "content": special_text.sub(mark, _text(m))} if _text(m) else m for m in messages]
        rendered = render(marked)
        # Put the literal text back, remembering where each forged piece lies in the final text.
        marker = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        spans: set[tuple[int, int]] = set()
        parts: list[str] = []
        length = 0
        position = 0
        for match in marker.finditer(rendered):
            parts.append(rendered[position : match.start()])
            length += match.start() - position
            literal = forged[int(match.group(1))]
            spans.add((length, length + len(literal)))
            parts.append(literal)
            length += len(literal)
            position = match.end()
        parts.append(rendered[position:])
        if not spans:
            raise TokenizerError(
                "a message contains special-token text (e.g. "
                f"{forged[0]!r}) that this model's chat template does not pass through unchanged; remove it"
            )
        text = "".join(parts)
        encoding = self._encoding(text, add_special_tokens=False)
        ids: list[int] = []
        for token_id, offset in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self._special_ids and tuple(offset) in spans:
                ids.extend(
                    self._plain_tokenizer().encode(text[offset[0] : offset[1]], add_special_tokens=False).ids
                )
            else:
                ids.append(token_id)
        return ids

    def _plain_tokenizer(self) -> HFTokenizer:
        if self._plain is None:
            plain = HFTokenizer.from_str(self._tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a multi-byte character.

    Each new token's text is the decode of a short window of recent tokens minus the text the window
    already produced (byte-level BPE tokens do not decode independently: spaces and UTF-8 sequences
    span tokens). While the window's tail decodes to U+FFFD (an incomplete UTF-8 sequence) nothing is
    emitted; the bytes are released once the character is complete.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A few prompt tokens of context so the first generated token decodes as it would mid-text.
        self._ids: list[int] = list(prompt_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an incomplete character as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
