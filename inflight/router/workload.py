"""A multi-turn chat workload for measuring routing policies: conversations whose every turn extends the last.

Each conversation starts with its own user message; every turn sends the whole conversation so far
(previous answers included) plus a new user message, streaming, and records the time to the first
content token. Conversations run concurrently, their turns one after another. Used by the router's tests
and by benchmarks/router_affinity.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "river",
    "stone",
    "cloud",
    "field",
    "table",
    "window",
    "garden",
    "market",
    "silver",
    "paper",
    "engine",
    "signal",
    "bridge",
    "forest",
    "harbor",
    "island",
    "meadow",
    "orbit",
    "planet",
]


FIRST_WORDS = 60  # words in a conversation's first message


@dataclass
class WorkloadResult:
    ttfts: list[float] = field(default_factory=list)
    requests: int = 0

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttfts) if self.ttfts else float("nan")


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def opening(seed: int, index: int, words: int) -> tuple[dict[str, str], random.Random]:
    """Conversation `index`'s first user message, and the generator its later turns continue from."""
    rng = random.Random(f"{seed}-{index}")
    return {"role": "user", "content": f"Conversation {seed}-{index}. " + sentence(rng, words)}, rng


async def chat_turn(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, float]:
    """One streamed chat completion: (the answer's text, seconds to its first content token)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first if first is not None else time.perf_counter() - started
                    parts.append(content)
    return "".join(parts), first if first is not None else time.perf_counter() - started


async def run_conversations(
    url: str,
    model: str,
    conversations: int,
    turns: int,
    seed: int,
    first_words: int = FIRST_WORDS,
    turn_words: int = 20,
    max_tokens: int = 8,
) -> WorkloadResult:
    """Run the workload against `url` (a router or a server); TTFT of every turn."""
    result = WorkloadResult()

    async def conversation(client: httpx.AsyncClient, index: int) -> None:
        first, rng = opening(seed, index, first_words)
        messages = [first]
        for turn in range(turns):
            answer, ttft = await chat_turn(client, url, model, messages, max_tokens)
            result.ttfts.append(ttft)
            result.requests += 1
            if turn + 1 < turns:
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": sentence(rng, turn_words)},
                ]

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(conversation(client, i) for i in range(conversations)))
    return result
