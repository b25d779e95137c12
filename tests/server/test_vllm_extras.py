"""vLLM's request extensions: the sampling and streaming extras it documents, and unknown fields."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from inflight.engine.tokenizer import Tokenizer

LiveServer = Any  # tests/server/conftest.py's LiveServer
PROMPT = "def add(a, b):\n    return"


def complete(live: LiveServer, **body: Any) -> dict[str, Any]:
    payload = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    response = httpx.post(f"{live.url}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def chat(live: LiveServer, **body: Any) -> httpx.Response:
    payload = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{live.url}/v1/chat/completions", json=payload, timeout=60)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    data = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(live: LiveServer, path: str) -> None:
    body: dict[str, Any] = {
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    response = httpx.post(f"{live.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    chunks = events(response)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 6
    assert len({u["prompt_tokens"] for u in usages}) == 1


def test_min_tokens_keeps_stop_tokens_away_until_reached(live: LiveServer) -> None:
    free = complete(live, logprobs=0)
    first = free["choices"][0]["logprobs"]["tokens"][0]
    first_id = httpx.post(f"{live.url}/tokenize", json={"prompt": first}, timeout=60).json()["tokens"][-1]
    stopped = complete(live, stop_token_ids=[first_id])
    assert stopped["usage"]["completion_tokens"] == 1
    held = complete(live, stop_token_ids=[first_id], min_tokens=4)
    assert held["usage"]["completion_tokens"] >= 4


def test_include_stop_str_in_output_keeps_the_stop_string(live: LiveServer) -> None:
    text = complete(live, ignore_eos=True)["choices"][0]["text"]
    stop = text[2:4]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = complete(live, ignore_eos=True, stop=[stop])["choices"][0]
    kept = complete(live, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert cut["text"] == text[: text.index(stop)]
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    assert kept["finish_reason"] == "stop" and kept["stop_reason"] == stop


def test_truncate_prompt_tokens_keeps_the_prompt_end(live: LiveServer) -> None:
    ids = list(range(10, 40))
    whole = complete(live, prompt=ids)
    short = complete(live, prompt=ids, truncate_prompt_tokens=5)
    same = complete(live, prompt=ids[-5:])
    assert whole["usage"]["prompt_tokens"] == 30 and short["usage"]["prompt_tokens"] == 5
    assert short["choices"][0]["text"] == same["choices"][0]["text"]
    response = chat(live, truncate_prompt_tokens=3)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 3


def test_add_generation_prompt_and_continue_final_message(live: LiveServer) -> None:
    with_prompt = chat(live).json()["usage"]["prompt_tokens"]
    without = chat(live, add_generation_prompt=False).json()["usage"]["prompt_tokens"]
    assert without < with_prompt
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    both = chat(live, messages=messages, continue_final_message=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    continued = chat(live, messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert continued.status_code == 200, continued.text


def test_continue_final_message_ends_the_text_with_the_last_message(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    opened = tokenizer.apply_chat_template(messages, continue_final_message=True)
    assert opened.endswith("The answer is") and closed.startswith(opened) and closed != opened


def test_chat_template_kwargs_reach_the_template(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    tokenizer.chat_template = "{{ greeting }}{% for m in messages %}|{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, variables={"greeting": "hey"}) == "hey|Hi"
    # The request's variables cannot replace the messages.
    assert tokenizer.apply_chat_template(messages, variables={"messages": []}) == "|Hi"


def test_vllm_sampling_extras_are_accepted(live: LiveServer) -> None:
    extras = {
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "priority": 3,
        "length_penalty": 1.0,
        "use_beam_search": False,
        "add_special_tokens": False,
    }
    assert complete(live, **extras)["usage"]["completion_tokens"] == 8
    response = chat(live, chat_template_kwargs={"enable_thinking": False}, top_k=3, min_tokens=2)
    assert response.status_code == 200, response.text


def test_unknown_fields_are_ignored_with_a_log_line(
    live: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        answer = complete(live, some_other_servers_field={"x": 1})
    assert answer == {**answer, "object": "text_completion"}
    assert "some_other_servers_field" in caplog.text
    assert chat(live, another_extra=True).status_code == 200


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("max_token", 5, "max_token"),  # a typo of max_tokens
        ("temprature", 0.5, "temprature"),
        ("use_beam_search", True, "use_beam_search"),
        ("min_tokens", -1, "min_tokens"),
        ("truncate_prompt_tokens", 0, "truncate_prompt_tokens"),
        ("stream_options", {"continuous_usage_stats": True, "bogus": 1}, "stream_options.bogus"),
    ],
)
def test_typos_and_unsupported_extras_are_400(live: LiveServer, field: str, value: Any, param: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, field: value}
    if field == "stream_options":
        body["stream"] = True
    response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_min_tokens_above_max_tokens_is_400(live: LiveServer) -> None:
    response = httpx.post(
        f"{live.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "min_tokens": 5}, timeout=60
    )
    assert response.status_code == 400 and "min_tokens" in response.json()["error"]["message"]
