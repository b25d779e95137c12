"""The OpenAI API over real sockets: the official client, raw SSE, equality with the offline engine."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from inflight.engine.cpu.isa import cpu_isa
from inflight.engine.dtypes import resolve_dtype_name
from inflight.engine.engine import LLMEngine
from inflight.engine.sequence import SamplingParams

MODEL_NAME = "tiny"  # as the conftest's servers serve it
MAX_MODEL_LEN = 256
LiveServer = Any  # tests/server/conftest.py's LiveServer (test modules cannot import the conftest)

# Each over 8 tokens: a prompt of 1-8 tokens prefilled alone is multiplied in C (cpu/linear.py, as a decode
# step's rows are), prefilled beside another prompt by oneDNN, and the tiny model's bfloat16 greedy token
# can differ between the two; the served-equals-offline checks below compare one with the other.
PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\nfrom pathlib import Path\n\n",
    "class Stack:\n    def push(self, item):",
]


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def offline(engine: LLMEngine, prompt: str | list[int], **params: Any) -> tuple[str, list[int]]:
    output = engine.generate([prompt], SamplingParams(temperature=0.0, **params))[0].outputs[0]
    return output.text, output.token_ids


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (one data line, then a blank line)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    lines = list(response.iter_lines())
    i = 0
    while i < len(lines):
        if lines[i] == "":
            i += 1
            continue
        assert lines[i].startswith("data: "), lines[i]
        assert i + 1 == len(lines) or lines[i + 1] == "", "each event is one data line and a blank line"
        events.append(lines[i][len("data: ") :])
        i += 2
    return events


def test_completion_with_the_openai_client_equals_the_offline_engine(
    client: openai.OpenAI, offline_engine: LLMEngine
) -> None:
    for prompt in PROMPTS:
        text, tokens = offline(offline_engine, prompt, max_tokens=12)
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert response.object == "text_completion"
        assert response.choices[0].text == text
        assert response.choices[0].finish_reason == ("length" if len(tokens) == 12 else "stop")
        prompt_tokens = len(offline_engine.tokenizer.encode(prompt))
        assert response.usage is not None
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
            prompt_tokens,
            len(tokens),
        )
        assert response.usage.total_tokens == prompt_tokens + len(tokens)


def test_chat_with_the_openai_client_equals_the_offline_engine(
    client: openai.OpenAI, offline_engine: LLMEngine
) -> None:
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A loop?"}]
    rendered = offline_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = offline_engine.tokenizer.encode(rendered, add_special_tokens=False)
    text, tokens = offline(offline_engine, prompt_ids, max_tokens=10)
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == text
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(tokens)


def test_streaming_with_the_openai_client_equals_non_streaming(
    client: openai.OpenAI, offline_engine: LLMEngine
) -> None:
    prompt = PROMPTS[0]
    text, tokens = offline(offline_engine, prompt, max_tokens=16)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(tokens)
    assert all(c.usage is None for c in chunks[:-1])

    chat_stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chat_chunks = list(chat_stream)
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks)
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
    )
    assert streamed == whole.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_raw_sse_framing_and_done(live: LiveServer, offline_engine: LLMEngine) -> None:
    prompt = PROMPTS[2]
    text, _ = offline(offline_engine, prompt, max_tokens=9)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 9, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all("usage" not in c for c in chunks), "no usage key unless stream_options.include_usage"
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_n_choices_with_a_seed_are_reproducible(live: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 7}
    first = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    again = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert first["usage"]["completion_tokens"] == again["usage"]["completion_tokens"] >= 3
    assert first["usage"]["prompt_tokens"] == len(httpx.post(
        f"{live.url}/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"])  # fmt: skip

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=stream_body, timeout=60) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in first["choices"]]
    assert chunks[-1]["usage"] == first["usage"]


def test_several_prompts_in_one_request(live: LiveServer, offline_engine: LLMEngine) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "n": 2}
    response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    expected = [offline(offline_engine, p, max_tokens=6)[0] for p in PROMPTS[:2]]
    assert [c["text"] for c in response["choices"]] == [expected[0], expected[0], expected[1], expected[1]]


def test_completion_logprobs_and_echo_with_prompt_logprobs(live: LiveServer) -> None:
    prompt_ids = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "logprobs": 2}
    response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    logprobs = response["choices"][0]["logprobs"]
    assert (
        len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == response["usage"]["completion_tokens"]
    )
    for chosen, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert value <= 0
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-5), "greedy picks the most likely token"
        assert top[chosen] == pytest.approx(value)
    assert logprobs["text_offset"][0] == 0

    echo = {**body, "echo": True, "max_tokens": 1}
    scored = httpx.post(f"{live.url}/v1/completions", json=echo, timeout=60).json()
    choice = scored["choices"][0]
    assert choice["text"].startswith(PROMPTS[0])
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert scored["usage"]["prompt_tokens"] == len(prompt_ids)

    with httpx.stream("POST", f"{live.url}/v1/completions", json={**echo, "stream": True}, timeout=60) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def test_a_streamed_echo_with_logprobs_reassembles_to_the_json_answer(live: LiveServer) -> None:
    """Several prompts, n=2, several tokens: only each choice's first chunk carries the echoed prompt
    and its logprobs, and the text offsets run on across chunks."""
    body = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "n": 2, "echo": True, "logprobs": 2}
    whole = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()["choices"]
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(e)["choices"][0] for e in sse_events(r)[:-1]]
    for choice in whole:
        parts = [c for c in chunks if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in parts) == choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in parts for v in c["logprobs"][key]] == choice["logprobs"][key], key
        assert parts[-1]["finish_reason"] == choice["finish_reason"] == "length"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert response.choices[0].logprobs is not None
    content = response.choices[0].logprobs.content
    assert content is not None and len(content) == response.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())


def test_stop_strings_and_stop_token_ids(live: LiveServer, offline_engine: LLMEngine) -> None:
    prompt = PROMPTS[1]
    text, tokens = offline(offline_engine, prompt, max_tokens=24, ignore_eos=True)
    # Two visible characters from the middle of the greedy text, whose first occurrence is not at 0.
    stop = next(
        text[i : i + 2]
        for i in range(len(text) // 2, len(text) - 1)
        if not text[i : i + 2].isspace()
        and len(text[i : i + 2].strip()) == 2
        and text.index(text[i : i + 2]) > 0
    )
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{live.url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    assert response["choices"][0]["text"] == text[: text.index(stop)]
    assert response["choices"][0]["finish_reason"] == "stop"
    assert response["choices"][0]["stop_reason"] == stop

    by_token = {**body, "stop_token_ids": [tokens[3]]}
    response = httpx.post(f"{live.url}/v1/completions", json=by_token, timeout=60).json()
    assert response["choices"][0]["finish_reason"] == "stop"
    assert response["usage"]["completion_tokens"] == tokens.index(tokens[3]) + 1


def test_models_tokenize_detokenize_version(live: LiveServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{live.url}/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    tokens = httpx.post(f"{live.url}/tokenize", json={"prompt": "for i in range(3):"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{live.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "for i in range(3):"
    chat = httpx.post(f"{live.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tokens["count"] // 4
    assert httpx.get(f"{live.url}/version").json()["version"]


def test_probes(live: LiveServer) -> None:
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{live.url}/ready").json()["status"] == "ready"


def test_metrics_count_exactly_what_was_served(live: LiveServer) -> None:
    before_prompt = live.metric("inflight:prompt_tokens_total")
    before_generated = live.metric("inflight:generation_tokens_total")
    before_length = live.metric("inflight:request_success_total", 'finished_reason="length"')
    before_ttft = live.metric("inflight:time_to_first_token_seconds_count")
    body = {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    usage = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()["usage"]
    assert live.metric("inflight:prompt_tokens_total") - before_prompt == usage["prompt_tokens"]
    assert live.metric("inflight:generation_tokens_total") - before_generated == 7
    assert live.metric("inflight:request_success_total", 'finished_reason="length"') - before_length == 1
    assert live.metric("inflight:time_to_first_token_seconds_count") - before_ttft == 1
    text = httpx.get(f"{live.url}/metrics").text
    for name in (
        "inflight:num_requests_running",
        "inflight:num_requests_waiting",
        "inflight:kv_cache_usage_perc",
        "inflight:num_preemptions_total",
        "inflight:time_per_output_token_seconds_bucket",
        "inflight:e2e_request_latency_seconds_bucket",
    ):
        assert f"\n{name}" in text, name
    assert live.metric("inflight:kv_cache_blocks_total") == 128
    assert live.metric("inflight:max_slots") == 8
    dtype = resolve_dtype_name("auto", False, native_cpu_bfloat16=cpu_isa().native_bfloat16)  # this CPU's
    info = f'inflight:engine_info{{dtype="{dtype}",kv_cache_dtype="{dtype}",tensor_parallel_size="1"}} 1.0'
    assert info in text
    hits = live.metric("inflight:prefix_cache_hits_total")
    assert live.metric("inflight:prefix_cache_queries_total") >= hits


def test_metrics_count_api_responses_by_status_code(live: LiveServer) -> None:
    ok, bad = 'status_code="200"', 'status_code="400"'
    before_ok = live.metric("inflight:http_responses_total", ok)
    before_bad = live.metric("inflight:http_responses_total", bad)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.post(f"{live.url}/v1/completions", json={**body, "max_tokens": -1}).status_code == 400
    httpx.get(f"{live.url}/health")  # probes are not API responses
    assert live.metric("inflight:http_responses_total", ok) - before_ok == 1
    assert live.metric("inflight:http_responses_total", bad) - before_bad == 1


def test_access_log_is_json_without_prompt_text(live: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    secret = "SECRET-PROMPT-TEXT"
    access = logging.getLogger("inflight.access")
    access.addHandler(caplog.handler)  # directly: `inflight serve` stops this logger propagating
    try:
        with caplog.at_level(logging.INFO, logger="inflight.access"):
            body = {"model": MODEL_NAME, "prompt": secret, "max_tokens": 3, "ignore_eos": True}
            httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 60  # a hang guard: the line comes right after the response
            while (
                not any("/v1/completions" in r.message for r in caplog.records)
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)
    finally:
        access.removeHandler(caplog.handler)
    lines = [json.loads(r.message) for r in caplog.records if r.name == "inflight.access"]
    line = next(entry for entry in lines if entry["path"] == "/v1/completions")
    assert line["method"] == "POST" and line["status"] == 200
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
    assert line["latency_ms"] > 0
    assert all(secret not in r.message for r in caplog.records)


def test_dropped_streams_are_aborted_and_free_every_block(
    live: LiveServer, step_gate: Any, wait_for: Any
) -> None:
    gate = step_gate(live)  # steps run only when the test allows them: nothing can finish on its own
    before = {
        reason: live.metric("inflight:request_success_total", f'finished_reason="{reason}"')
        for reason in ("abort", "length")
    }
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    clients = [httpx.Client(timeout=60) for _ in range(12)]  # 12 streams > 8 slots: some wait in the queue
    streams = []
    for c in clients:
        stream = c.stream("POST", f"{live.url}/v1/completions", json=body)
        streams.append((stream, stream.__enter__()))  # the headers come before the first token
    lines = [response.iter_lines() for _, response in streams]  # referenced: dropping one disconnects
    assert live.engine.num_in_flight == 12
    while live.engine.stats().num_running < 8:  # step by step until the first eight run
        gate.allow(1)
        gate.wait_until_held()
    for line_iterator in lines[:8]:  # admitted first (first come, first served): each has a token
        assert next(line_iterator).startswith("data: ")
    assert live.metric("inflight:num_requests_running") == 8
    assert live.metric("inflight:num_requests_waiting") == 4
    for (stream, _), c in zip(streams, clients, strict=True):
        stream.__exit__(None, None, None)
        c.close()
    wait_for(lambda: live.engine.num_in_flight == 0, "the server to abort the dropped streams")
    steps_before = live.engine.stats().num_steps
    gate.open()
    wait_for(
        lambda: (
            (s := live.engine.stats()).num_steps > steps_before
            and s.num_running == 0
            and s.num_waiting == 0
            and s.num_used_blocks == 0
        ),
        "the engine to free every block",
    )
    assert live.metric("inflight:num_requests_running") == 0
    assert live.metric("inflight:num_requests_waiting") == 0
    assert live.metric("inflight:kv_cache_usage_perc") == 0
    # every dropped stream ended as an abort (per sequence); none ran to its length
    after = {
        reason: live.metric("inflight:request_success_total", f'finished_reason="{reason}"')
        for reason in before
    }
    assert after["abort"] - before["abort"] == 12
    assert after["length"] == before["length"]
    # the server still serves
    response = httpx.post(f"{live.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_non_streaming_client_that_leaves_aborts_its_request(
    live: LiveServer, step_gate: Any, wait_for: Any
) -> None:
    gate = step_gate(live)  # the engine runs no step until the test says so: the request cannot finish
    before = live.engine.stats()
    payload = json.dumps({"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True})
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode()
        )
        gate.wait_until_held()  # the request is in the engine, before its first step
        assert live.engine.num_in_flight == 1
    # The client left. The server notices and forgets the request while the engine is still held.
    wait_for(lambda: live.engine.num_in_flight == 0, "the server to abort the request")
    gate.open()
    # The held step runs (stats published after it show the request), then the engine thread applies
    # the abort on its next loop and frees the blocks.
    wait_for(
        lambda: (
            (s := live.engine.stats()).num_steps > before.num_steps
            and s.num_running == 0
            and s.num_waiting == 0
            and s.num_used_blocks == 0
        ),
        "the engine to free the request's blocks",
    )
    assert live.engine.stats().num_generation_tokens - before.num_generation_tokens < 240  # cut short
