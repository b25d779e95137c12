"""Hostile and absurd inputs, one kind per case, across every endpoint: each is a 4xx with an OpenAI
error body (never a 5xx), with the status and the field that a client needs to fix it.

The live server has 8 slots and a queue of 64, a 256-token context and the default body-size limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from inflight.server.limits import DEFAULT_MAX_BODY_BYTES

LiveServer = Any  # tests/server/conftest.py's LiveServer (test modules cannot import the conftest)

COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass(frozen=True)
class Bad:
    kind: str
    path: str
    body: dict[str, Any] | bytes
    status: int = 400
    param: str | None = None
    code: str | None = None
    method: str = "POST"


def completion(**change: Any) -> dict[str, Any]:
    return {**COMPLETION, **change}


def chat(**change: Any) -> dict[str, Any]:
    return {**CHAT, **change}


def chat_content(content: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": content}])


C, CH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
NOT_SUPPORTED = "not_supported"
CONTENT = "messages[0].content"
TOO_BIG = b" " * (DEFAULT_MAX_BODY_BYTES + 1)

CASES = [
    # numbers the sampler cannot take (overflow, inf/NaN logits) or that are absurd
    Bad("top_k 2**63", C, completion(top_k=2**63), param="top_k"),
    Bad("top_k 2**31", C, completion(top_k=2**31), param="top_k"),
    Bad("top_k float", C, completion(top_k=1.5), param="top_k"),
    Bad("n 2**63", C, completion(n=2**63), param="n"),
    Bad("n 10**6", C, completion(n=10**6), param="n"),
    Bad("max_tokens 2**63", C, completion(max_tokens=2**63), param="max_tokens"),
    Bad("max_tokens 10**30", C, completion(max_tokens=10**30), param="max_tokens"),
    Bad("logprobs 10**9", C, completion(logprobs=10**9), param="logprobs"),
    Bad("logprobs -1", C, completion(logprobs=-1), param="logprobs"),
    Bad("seed 2**64", C, completion(seed=2**64), param="seed"),
    Bad("seed -2**63", C, completion(seed=-(2**63)), param="seed"),
    Bad("seed 1e30", C, completion(seed=1e30), param="seed"),
    Bad("temperature inf", C, completion(temperature=float("inf")), param="temperature"),
    Bad("temperature NaN", C, completion(temperature=float("nan")), param="temperature"),
    Bad("temperature -inf", C, completion(temperature=float("-inf")), param="temperature"),
    Bad("temperature string", C, completion(temperature="hot"), param="temperature"),
    Bad("top_p NaN", C, completion(top_p=float("nan")), param="top_p"),
    Bad("top_p -1e-300", C, completion(top_p=-1e-300), param="top_p"),
    Bad("repetition_penalty 1e-300", C, completion(repetition_penalty=1e-300), param="repetition_penalty"),
    Bad("repetition_penalty 1e9", C, completion(repetition_penalty=1e9), param="repetition_penalty"),
    Bad("presence_penalty 1e300", C, completion(presence_penalty=1e300), param="presence_penalty"),
    Bad("frequency_penalty -1e300", C, completion(frequency_penalty=-1e300), param="frequency_penalty"),
    Bad("min_p -1e-300", C, completion(min_p=-1e-300), param="min_p"),
    Bad("min_p inf", C, completion(min_p=float("inf")), param="min_p"),
    Bad("stop_token_ids 2**63", C, completion(stop_token_ids=[2**63]), param="stop_token_ids"),
    Bad("stop_token_ids x10000", C, completion(stop_token_ids=[1] * 10_000), param="stop_token_ids"),
    Bad("best_of 2**63", C, completion(best_of=2**63), param="best_of"),
    Bad("logit_bias NaN", C, completion(logit_bias={"5": float("nan")}), param="logit_bias.5"),
    # prompts
    Bad("prompt token id 2**63", C, completion(prompt=[1, 2**63]), param="prompt"),
    Bad("prompt nested id 2**64", C, completion(prompt=[[2**64]]), param="prompt"),
    Bad("prompt object", C, completion(prompt={"a": 1}), param="prompt"),
    Bad("prompt bool", C, completion(prompt=True), param="prompt"),
    Bad("prompt lone surrogate", C, completion(prompt="a\ud800b"), param="prompt"),
    Bad("prompt list lone surrogate", C, completion(prompt=["ok", "\udfff"]), param="prompt"),
    Bad("stop lone surrogate", C, completion(stop="\ud800"), param="stop"),
    Bad("prompts x n beyond slots+queue", C, completion(prompt=["a"] * 73), param="prompt"),
    Bad("n x prompts beyond slots+queue", C, completion(prompt=["a"] * 10, n=8), param="n"),
    Bad("surrogate as a field name", C, b'{"prompt": "x", "\\ud800": 1}'),
    # chat
    Bad("chat content lone surrogate", CH, chat_content("hi \ud800"), param=CONTENT),
    Bad(
        "chat part lone surrogate",
        CH,
        chat_content([{"type": "text", "text": "\udc00"}]),
        param="messages[0].content",
    ),
    Bad("chat name lone surrogate", CH, chat(messages=[{"role": "user", "content": "x", "name": "\ud800"}])),
    Bad(
        "chat tool name",
        CH,
        chat(tools=[{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]),
        param="tools[0].function.name",
    ),
    Bad("chat tool_choice without tools", CH, chat(tool_choice="auto"), param="tool_choice"),
    Bad("chat functions", CH, chat(functions=[{"name": "f"}]), param="functions", code=NOT_SUPPORTED),
    Bad(
        "chat response_format json_schema without a schema",
        CH,
        chat(response_format={"type": "json_schema"}),
        param="response_format",
    ),
    Bad(
        "chat response_format schema not an object",
        CH,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        param="response_format.json_schema.schema",
    ),
    Bad("chat top_logprobs 2**63", CH, chat(logprobs=True, top_logprobs=2**63), param="top_logprobs"),
    Bad("chat max_completion_tokens 2**63", CH, chat(max_completion_tokens=2**63)),
    Bad("chat n 2**63", CH, chat(n=2**63), param="n"),
    Bad("chat n beyond slots+queue", CH, chat(n=64), param="n"),
    # token endpoints
    Bad("tokenize lone surrogate", TOK, {"prompt": "\ud800"}, param="prompt"),
    Bad("tokenize messages lone surrogate", TOK, {"messages": [{"role": "user", "content": "\udbff"}]}),
    Bad("tokenize prompt and messages", TOK, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
    Bad("detokenize id 2**63", DETOK, {"tokens": [2**63]}, param="tokens"),
    Bad("detokenize string", DETOK, {"tokens": "abc"}, param="tokens"),
    # transport
    Bad(
        "body over the size limit", C, b" " * (DEFAULT_MAX_BODY_BYTES + 1), status=413, code="body_too_large"
    ),
    Bad(
        "model id with slashes",
        "/v1/models/org/name/x",
        b"",
        status=404,
        code="model_not_found",
        method="GET",
    ),
]


def send(server: LiveServer, case: Bad) -> httpx.Response:
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    return httpx.request(
        case.method,
        f"{server.url}{case.path}",
        content=content if case.method == "POST" else None,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )


@pytest.mark.parametrize("case", CASES, ids=[case.kind for case in CASES])
def test_bad_input_is_a_4xx_with_an_openai_error(live: LiveServer, case: Bad) -> None:
    response = send(live, case)
    assert response.status_code == case.status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if case.param is not None:
        assert body["error"]["param"] == case.param, body
    if case.code is not None:
        assert body["error"]["code"] == case.code, body


def test_there_are_at_least_40_kinds() -> None:
    assert len({case.kind for case in CASES}) == len(CASES) >= 40


def test_tiny_temperature_and_top_p_are_greedy_not_failed(live: LiveServer) -> None:
    """temperature 1e-300 samples greedily (documented: below 1e-5), top_p 1e-300 keeps the top token."""
    body = completion(temperature=1e-300, top_p=1e-300, max_tokens=4, ignore_eos=True)
    clamped = httpx.post(f"{live.url}{C}", json=body, timeout=60)
    assert clamped.status_code == 200, clamped.text
    greedy = httpx.post(f"{live.url}{C}", json={**body, "temperature": 0, "top_p": 1}, timeout=60)
    assert clamped.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert live.engine.state == "ready"
