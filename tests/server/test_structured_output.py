"""Structured output over HTTP: response_format (json_object, json_schema), vLLM's guided_*, logit_bias;
outputs validate against their schemas; bad schemas are 400s naming the field."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

LiveServer = Any  # tests/server/conftest.py's LiveServer

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "kind", "ok"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Give me a pet as JSON."}]


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


class Size(BaseModel):
    width: int = Field(ge=1, le=9)
    height: int = Field(ge=1, le=9)


class Item(BaseModel):
    colour: Colour
    size: Size
    sold: bool


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=120)


def test_the_sdks_parse_returns_a_parsed_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Item, max_tokens=100, temperature=1.0, seed=seed
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Item), completion.choices[0].message.content


@pytest.mark.parametrize("n", [1, 3])
def test_json_schema_outputs_validate_json_and_streamed(live: LiveServer, n: int) -> None:
    body = {
        "messages": MESSAGES,
        "response_format": SCHEMA_FORMAT,
        "max_tokens": 60,
        "n": n,
        "temperature": 1,
    }
    answer = post(live, "/v1/chat/completions", body).json()
    for choice in answer["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**body, "stream": True}) as response:
        texts = [""] * n
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_response_format_and_vllms_guided_fields(live: LiveServer) -> None:
    base = {"prompt": "Answer:", "max_tokens": 60, "temperature": 1}
    # Any JSON object: its strings are unbounded, so a greedy prompt the random model closes quickly.
    greedy_object = {
        "prompt": "x",
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    as_object = post(live, "/v1/completions", greedy_object).json()
    assert isinstance(json.loads(as_object["choices"][0]["text"]), dict)
    guided_json = post(live, "/v1/completions", {**base, "guided_json": SCHEMA}).json()
    jsonschema.validate(json.loads(guided_json["choices"][0]["text"]), SCHEMA)
    choice = post(live, "/v1/completions", {**base, "guided_choice": ["left", "right"]}).json()
    assert choice["choices"][0]["text"] in ("left", "right")
    regex = post(live, "/v1/completions", {**base, "guided_regex": "[0-9]{3}-[a-z]{2}"}).json()
    text = regex["choices"][0]["text"]
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text


def test_logit_bias_steers_the_draw(live: LiveServer) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    forced = post(live, "/v1/completions", {**body, "logit_bias": {"300": 100}}).json()
    assert forced["choices"][0]["logprobs"]["tokens"] == [forced["choices"][0]["logprobs"]["tokens"][0]] * 4
    plain = post(live, "/v1/completions", {**body, "logit_bias": {}}).json()
    assert plain["choices"][0]["text"] != forced["choices"][0]["text"]


HOSTILE_SCHEMAS: list[tuple[str, Any]] = [
    ("recursion only", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    ("huge enum", {"enum": [f"value-{i}" for i in range(100_000)]}),
    ("unsupported keyword", {"type": "object", "not": {"type": "string"}}),
    ("unknown format", {"type": "string", "format": "no-such-format"}),
    ("invalid regex", {"type": "string", "pattern": "(["}),
    ("no string fits", {"type": "string", "minLength": 5, "maxLength": 2}),
    ("incompatible allOf", {"allOf": [{"type": "string"}, {"type": "integer"}]}),
    ("unknown type", {"type": "foo"}),
    ("min above max", {"type": "integer", "minimum": 5, "maximum": 1}),
    ("deep nesting", json.loads('{"type":"array","items":' * 300 + "{}" + "}" * 300)),
    ("bad $ref", {"$ref": "#/$defs/missing"}),
    ("remote $ref", {"$ref": "https://example.com/schema.json"}),
    ("schema too big", {"type": "object", "description": "x" * (1 << 20)}),
    ("minItems above maxItems", {"type": "array", "minItems": 3, "maxItems": 1}),
    ("empty enum", {"enum": []}),
    ("required but forbidden", {"type": "object", "required": ["a"], "additionalProperties": False}),
    (
        "no integer between exclusive bounds",
        {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
    ),
    ("const of another type", {"type": "string", "const": 5}),
    ("enum of another type", {"type": "integer", "enum": ["a", "b"]}),
    (
        "recursion with no way out",
        {
            "$ref": "#/$defs/a",
            "$defs": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
            },
        },
    ),
    ("pattern and length disagree", {"type": "string", "pattern": "^a$", "minLength": 3}),
]


@pytest.mark.parametrize(("name", "schema"), HOSTILE_SCHEMAS, ids=[h[0] for h in HOSTILE_SCHEMAS])
def test_hostile_schemas_are_400_naming_response_format(live: LiveServer, name: str, schema: Any) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        },
    }
    response = post(live, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"
    # The server keeps serving.
    assert post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_10_mb_schema_is_413_before_it_is_parsed(live: LiveServer) -> None:
    schema = {"type": "object", "description": "x" * (10 << 20)}
    body = {
        "messages": MESSAGES,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    response = post(live, "/v1/chat/completions", body)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "(["}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
    ],
)
def test_bad_constraints_are_400(live: LiveServer, change: dict[str, Any], param: str) -> None:
    response = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 4, **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_constrained_requests_are_counted(live: LiveServer) -> None:
    before = live.metric("inflight:constrained_requests_total", 'field="guided_choice"')
    post(live, "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_choice": ["a", "b"]})
    assert live.metric("inflight:constrained_requests_total", 'field="guided_choice"') == before + 1
    assert live.metric("inflight:grammar_compile_seconds_count") >= 1
