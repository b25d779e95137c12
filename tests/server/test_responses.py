"""/v1/responses with the openai SDK's own types: text and message input, instructions, text.format,
function tools and their outputs, previous_response_id, streaming events, refusals of what is not served."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from support.tool_schemas import WEATHER

LiveServer = Any  # tests/server/conftest.py's LiveServer

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Forecast.", "parameters": WEATHER}
]


@pytest.fixture(scope="module")
def client(roomy_live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{roomy_live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_input_with_instructions(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=6
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.output_text and response.output[0].type == "message"
    assert response.usage is not None and response.usage.output_tokens == 6
    assert response.usage.total_tokens == response.usage.input_tokens + 6


def test_text_format_json_schema_validates(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "Weather as JSON"}],
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        max_output_tokens=60,
    )
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.status == "completed"


def test_an_agent_loop_with_function_tools(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny", input="Weather in Oslo?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # The tool's output goes back, chained to the stored conversation.
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"forecast": "sun"}'}
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
    )
    assert second.output_text and second.previous_response_id == first.id
    # Stateless: the same turn with the whole history as input items.
    third = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"forecast": "sun"}'},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        store=False,
    )
    assert third.usage is not None and second.usage is not None
    assert third.usage.input_tokens == second.usage.input_tokens  # the same prompt either way


def test_streaming_events(client: openai.OpenAI) -> None:
    kinds = []
    text = ""
    final = None
    for event in client.responses.create(model="tiny", input="Hi", max_output_tokens=5, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_item.added" in kinds
    assert final is not None and final.output_text == text


def test_streamed_function_calls(client: openai.OpenAI) -> None:
    arguments, done = "", None
    stream = client.responses.create(
        model="tiny",
        input="Weather?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        stream=True,
    )
    for event in stream:
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.function_call_arguments.done":
            done = event.arguments
    assert done == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"background": True}, "background"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}},
            "text.format",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ],
)
def test_what_cannot_be_served_is_400(roomy_live: LiveServer, change: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{roomy_live.url}/v1/responses", json={"input": "x", **change}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_stored_response_is_fetched_and_deleted(client: openai.OpenAI, roomy_live: LiveServer) -> None:
    answered = client.responses.create(model="tiny", input="Hello", max_output_tokens=5)
    assert client.responses.retrieve(answered.id) == answered
    with client.responses.create(model="tiny", input="Hi", max_output_tokens=5, stream=True) as stream:
        final = next(event.response for event in stream if event.type == "response.completed")
    assert client.responses.retrieve(final.id) == final
    client.responses.delete(answered.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answered.id)
    unstored = client.responses.create(model="tiny", input="Hello", max_output_tokens=5, store=False)
    for method in ("GET", "DELETE"):
        for response_id in (answered.id, unstored.id, "resp_unknown"):
            response = httpx.request(method, f"{roomy_live.url}/v1/responses/{response_id}", timeout=60)
            assert response.status_code == 404, response.text
            error = response.json()["error"]
            assert error["code"] == "response_not_found" and error["param"] == "response_id"
            assert response_id in error["message"]


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
FILE = {"type": "input_file", "file_id": "file-1"}


@pytest.mark.parametrize("part", [IMAGE, FILE], ids=["image", "file"])
def test_image_and_file_input_parts_are_400_naming_the_field(roomy_live: LiveServer, part: Any) -> None:
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, part]}]}
    response = httpx.post(f"{roomy_live.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("input") and part["type"] in error["message"], error
