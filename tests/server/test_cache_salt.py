"""`cache_salt` over HTTP: requests share cached prompt prefixes only when their salts match."""

from __future__ import annotations

from typing import Any

import httpx

LiveServer = Any  # tests/server/conftest.py's LiveServer

# Long enough for several full 16-token KV blocks.
PROMPT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
)


def prefix_hits(live: LiveServer, path: str, body: dict[str, Any]) -> int:
    """How many prompt tokens this one request found in the prefix cache."""
    before = live.engine.stats().num_prefix_cache_hits
    response = httpx.post(f"{live.url}{path}", json={"model": "tiny", "max_tokens": 1, **body}, timeout=60)
    assert response.status_code == 200, response.text
    hits: int = live.engine.stats().num_prefix_cache_hits - before
    return hits


def test_completions_share_prefixes_only_within_a_salt(live: LiveServer) -> None:
    path, first = "/v1/completions", {"prompt": PROMPT + "# tenant test 1\n", "cache_salt": "tenant-a"}
    assert prefix_hits(live, path, first) == 0  # nothing cached yet for this prompt
    assert prefix_hits(live, path, first) > 0  # the same salt: the cached blocks are reused
    assert prefix_hits(live, path, {**first, "cache_salt": "tenant-b"}) == 0
    assert prefix_hits(live, path, {"prompt": first["prompt"]}) == 0  # unsalted requests are apart too


def test_chat_completions_share_prefixes_only_within_a_salt(live: LiveServer) -> None:
    messages = [{"role": "user", "content": PROMPT + "# tenant test 2\n"}]
    path = "/v1/chat/completions"
    assert prefix_hits(live, path, {"messages": messages, "cache_salt": "x"}) == 0
    assert prefix_hits(live, path, {"messages": messages, "cache_salt": "y"}) == 0
    assert prefix_hits(live, path, {"messages": messages, "cache_salt": "x"}) > 0


def test_an_empty_cache_salt_is_a_400(live: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "cache_salt": ""}
    response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"
