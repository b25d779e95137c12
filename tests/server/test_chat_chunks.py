"""The chat stream's chunks: a step that produced tokens but no text yet (part of a character, a possible
stop string) sends nothing, and no delta carries `"role": null` or `"content": null`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from inflight.server.openai.chat import _Chat
from inflight.server.openai.common import ChoiceState
from inflight.server.openai.protocol import ChatCompletionRequest, Usage

Update = tuple[ChoiceState, str, list[int], list[Any]]


@dataclass
class FakeRun:
    """What `_Chat.chunks` reads of a RunState: one choice's updates, as the engine's steps made them."""

    steps: list[tuple[str, list[int], str | None]]
    request_id: str = "chatcmpl-test"
    choice: ChoiceState = field(default_factory=lambda: ChoiceState(index=0, prompt_index=0))

    async def updates(self) -> AsyncIterator[Update]:
        for text, tokens, finish in self.steps:
            if finish is not None:
                self.choice.finish(finish)
            yield self.choice, text, tokens, []

    def usage(self) -> Usage:
        return Usage(prompt_tokens=1, completion_tokens=4, total_tokens=5)


def stream(steps: list[tuple[str, list[int], str | None]]) -> list[dict[str, Any]]:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)  # type: ignore[list-item]
    ctx = SimpleNamespace(settings=SimpleNamespace(served_model_name="tiny"))
    chat = _Chat(ctx, body, FakeRun(steps))  # type: ignore[arg-type]

    async def collect() -> list[str]:
        return [chunk async for chunk in chat.chunks()]

    return [json.loads(event.removeprefix("data: ")) for event in asyncio.run(collect())]


def test_steps_without_text_send_no_chunk_and_no_delta_has_null_fields() -> None:
    chunks = stream(
        [("He", [1], None), ("", [2], None), ("", [3], None), ("llo", [4], None), ("", [], "stop")]
    )
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "He"}, {"content": "llo"}, {}]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, None, "stop"]
