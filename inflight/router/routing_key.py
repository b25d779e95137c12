"""The routing key of a request: the start of its prompt, which is what a replica's prefix cache reuses.

- completions: the first `max_chars` characters of the prompt (the first prompt of a batch; token ids
  rendered as text);
- chat: the conversation rendered as `role: content` lines through its first user message (system
  prompt included), capped at `max_chars`. Later turns repeat that start, so every turn of one
  conversation has the same key, while conversations that share only a system prompt get different keys.
- responses: its `instructions` and `input` read as a chat (a text input is one user message).
A request without a prompt has no key (the least loaded replica takes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_KEY_CHARS = 1024


def routing_key(body: Mapping[str, Any], max_chars: int = DEFAULT_KEY_CHARS) -> str | None:
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chat_key(messages, max_chars)
    if "input" in body:
        return _chat_key(_responses_messages(body), max_chars)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt[:max_chars] or None
    if isinstance(prompt, list) and prompt:  # token ids
        return " ".join(str(token) for token in prompt)[:max_chars]
    return None


def _responses_messages(body: Mapping[str, Any]) -> list[Any]:
    """A /v1/responses request's instructions and input as chat messages."""
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    items = body.get("input")
    if isinstance(items, str):
        return [*system, {"role": "user", "content": items}]
    return [*system, *(items if isinstance(items, list) else [])]


def _chat_key(messages: list[Any], max_chars: int) -> str | None:
    lines: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = str(message.get("role", ""))
        lines.append(f"{role}: {_text(message.get('content'))}")
        if role == "user":
            break
    key = "\n".join(lines)[:max_chars]
    return key or None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text")
        )
    return ""
