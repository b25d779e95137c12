"""Every client mistake gets its exact status and an OpenAI-style error body; auth, 429 and 503 included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

MODEL = "tiny"
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path, start_server_factory: Any) -> Iterator[Any]:
    """A server with an API key and room for exactly two sequences (2 slots, no queue)."""
    server = start_server_factory(tiny_llama_dir, api_key=KEY, max_slots=2, max_queue=0)
    yield server
    server.stop()


def post(server: Any, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"Content-Type": "application/json", **AUTH, **(headers or {})},
        timeout=60,
    )


def assert_error(
    response: httpx.Response, status: int, type_: str, param: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_COMPLETIONS = [
    ({"model": "gpt-9"}, "model", "model_not_found"),
    ({"prompt": None}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": 5}, "prompt", None),
    ({"prompt": [1, 2, 99_999]}, "prompt", None),
    ({"prompt": list(range(3, 303))}, "prompt", "context_length_exceeded"),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_tokens": -3}, "max_tokens", None),
    ({"max_tokens": "ten"}, "max_tokens", None),
    ({"max_tokens": 1000}, "max_tokens", "context_length_exceeded"),
    ({"n": 0}, "n", None),
    ({"n": 3}, "n", None),  # more than the server's 2 slots
    ({"n": 1000}, "n", None),
    ({"temperature": -0.5}, "temperature", None),
    ({"temperature": 2.5}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"top_k": -2}, "top_k", None),
    ({"min_p": 1.5}, "min_p", None),
    ({"repetition_penalty": 0}, "repetition_penalty", None),
    ({"presence_penalty": 3}, "presence_penalty", None),
    ({"seed": -1}, "seed", None),
    ({"logprobs": 21}, "logprobs", None),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", None),
    ({"stop": [""]}, "stop", None),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", None),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ({"logit_bias": {"5": 101.0}}, "logit_bias.5", None),
    ({"suffix": "x"}, "suffix", None),
    ({"best_of": 3}, "best_of", None),
    ({"max_token": 5}, "max_token", None),  # a typo is an error, not silently ignored
    # Numbers and booleans are not coerced from strings (OpenAI and vLLM reject these too).
    ({"max_tokens": "16"}, "max_tokens", None),
    ({"max_tokens": 16.0}, "max_tokens", None),
    ({"n": "1"}, "n", None),
    ({"temperature": "0.5"}, "temperature", None),
    ({"seed": True}, "seed", None),
    ({"stream": "true"}, "stream", None),
    ({"echo": 1}, "echo", None),
]


@pytest.mark.parametrize(
    ("change", "param", "code"), BAD_COMPLETIONS, ids=[str(c[0])[:40] for c in BAD_COMPLETIONS]
)
def test_bad_completion_requests_are_400(
    guarded: Any, change: dict[str, Any], param: str, code: str | None
) -> None:
    body = {k: v for k, v in {**COMPLETION, **change}.items() if v is not None}
    error = assert_error(post(guarded, "/v1/completions", body), 400, "invalid_request_error", param)
    if code is not None:
        assert error["code"] == code


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": "hi"}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_tokens"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"model": "other"}, "model"),
]


@pytest.mark.parametrize(("change", "param"), BAD_CHATS, ids=[str(c[0])[:40] for c in BAD_CHATS])
def test_bad_chat_requests_are_400(guarded: Any, change: dict[str, Any], param: str) -> None:
    assert_error(
        post(guarded, "/v1/chat/completions", {**CHAT, **change}), 400, "invalid_request_error", param
    )


def test_malformed_bodies_are_400(guarded: Any) -> None:
    error = assert_error(
        post(guarded, "/v1/completions", b'{"model": "tiny", '), 400, "invalid_request_error"
    )
    assert error["code"] == "invalid_json"
    assert_error(post(guarded, "/v1/completions", b"[1, 2]"), 400, "invalid_request_error")
    assert_error(post(guarded, "/v1/completions", b""), 400, "invalid_request_error")
    plain = httpx.post(f"{guarded.url}/v1/completions", content=b"hello", headers=AUTH)
    assert_error(plain, 400, "invalid_request_error")


def test_a_body_not_sent_as_json_names_the_content_type(guarded: Any) -> None:
    """curl -d sends application/x-www-form-urlencoded: the answer says which header to send."""
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        sent = httpx.post(
            f"{guarded.url}{path}",
            content=json.dumps(body).encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded", **AUTH},
        )
        error = assert_error(sent, 400, "invalid_request_error")
        assert error["code"] == "invalid_content_type"
        assert "application/x-www-form-urlencoded" in error["message"]
        assert "Content-Type: application/json" in error["message"]


def test_a_huge_wrong_model_name_is_cut_short_in_the_error(guarded: Any) -> None:
    name = "m" * 1_000_000
    for response in (
        post(guarded, "/v1/completions", {**COMPLETION, "model": name}),
        httpx.get(f"{guarded.url}/v1/models/{name[:4000]}", headers=AUTH),
    ):
        error = assert_error(response, response.status_code, response.json()["error"]["type"])
        assert error["code"] == "model_not_found"
        assert len(error["message"]) < 300 and " characters)" in error["message"], error["message"][:300]


def test_the_api_key_is_checked_before_the_body(guarded: Any) -> None:
    """Without the key, a malformed or oversized body still gets 401: nothing is parsed for a stranger."""
    for content in (b'{"model": "tiny", ', b"hello", b"[1, 2]"):
        response = httpx.post(
            f"{guarded.url}/v1/completions", content=content, headers={"Content-Type": "application/json"}
        )
        assert_error(response, 401, "authentication_error")
    wrong = httpx.post(
        f"{guarded.url}/v1/chat/completions",
        content=b"{",
        headers={"Content-Type": "application/json", "Authorization": "Bearer wrong"},
    )
    assert_error(wrong, 401, "authentication_error")


def test_token_endpoints_reject_bad_input(guarded: Any) -> None:
    assert_error(post(guarded, "/detokenize", {"tokens": [10**6]}), 400, "invalid_request_error", "tokens")
    assert_error(post(guarded, "/detokenize", {"tokens": [-1]}), 400, "invalid_request_error", "tokens[0]")
    assert_error(post(guarded, "/tokenize", {}), 400, "invalid_request_error", "prompt")
    assert_error(
        post(guarded, "/tokenize", {"prompt": "a", "model": "x"}), 400, "invalid_request_error", "model"
    )


def test_unknown_routes_and_methods(guarded: Any) -> None:
    assert_error(httpx.get(f"{guarded.url}/v1/nothing", headers=AUTH), 404, "not_found_error")
    assert_error(httpx.get(f"{guarded.url}/v1/completions", headers=AUTH), 405, "invalid_request_error")
    missing = httpx.get(f"{guarded.url}/v1/models/gpt-9", headers=AUTH)
    assert assert_error(missing, 404, "not_found_error")["code"] == "model_not_found"


def test_api_key_is_required_except_on_probes_and_metrics(guarded: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(f"{guarded.url}/v1/completions", json=COMPLETION, headers=headers)
        error = assert_error(response, 401, "authentication_error")
        assert error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.get(f"{guarded.url}/v1/models"), 401, "authentication_error")
    assert_error(httpx.post(f"{guarded.url}/tokenize", json={"prompt": "x"}), 401, "authentication_error")
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200, path
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    good = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]


def test_queue_full_is_429_with_retry_after(guarded: Any, step_gate: Any, wait_for: Any) -> None:
    gate = step_gate(guarded)  # the long request cannot finish (and free its slots) while we probe
    long = {**COMPLETION, "max_tokens": 200, "ignore_eos": True, "n": 2, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{guarded.url}/v1/completions", json=long, headers=AUTH),
    ):
        # The headers came back: it is in flight, both slots taken, and there is no queue.
        response = post(guarded, "/v1/completions", COMPLETION)
        assert_error(response, 429, "rate_limit_error")
        assert int(response.headers["retry-after"]) >= 1
        sdk = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError):
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    gate.open()
    wait_for(lambda: guarded.engine.num_in_flight == 0, "the dropped stream to be aborted")
    assert post(guarded, "/v1/completions", COMPLETION).status_code == 200


def test_draining_server_answers_503(guarded: Any) -> None:
    """Last in this module: the server stays draining."""
    guarded.call_in_loop(guarded.engine.drain(timeout=5))
    assert_error(post(guarded, "/v1/completions", COMPLETION), 503, "service_unavailable_error")
    assert_error(post(guarded, "/v1/chat/completions", CHAT), 503, "service_unavailable_error")
    assert_error(httpx.get(f"{guarded.url}/v1/models", headers=AUTH), 503, "service_unavailable_error")
    assert httpx.get(f"{guarded.url}/ready").status_code == 503
    assert httpx.get(f"{guarded.url}/health").status_code == 200
