"""Tool calling on /v1/chat/completions: tool_choice required / named enforced by the grammar, auto parsed
from the model's text, the history's calls and results through the chat template, streamed
delta.tool_calls, and an agent loop with the openai SDK's own types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from inflight.cli import build_parser
from inflight.engine.tokenizer import Tokenizer
from inflight.server.openai.protocol import ChatCompletionRequest, ChatMessage, Tool
from inflight.server.openai.tools import ToolCallStream, ToolPlan, plan_tools, template_messages
from inflight.server.tool_parsers import ParserChoice

from support.tool_schemas import WEATHER

LiveServer = Any  # tests/server/conftest.py's LiveServer

TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(roomy_live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{roomy_live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(roomy_live: LiveServer, **body: Any) -> httpx.Response:
    payload = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, **body}
    return httpx.post(f"{roomy_live.url}/v1/chat/completions", json=payload, timeout=120)


def assert_valid_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_required_and_named_calls_always_validate(roomy_live: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(10):
        for choice, names in (("required", set(SCHEMAS)), (named, {"get_time"})):
            # One call per answer: the random model, free to, makes calls until max_tokens.
            body = {
                "tool_choice": choice,
                "seed": seed,
                "temperature": 1.0,
                "n": 2,
                "parallel_tool_calls": False,
            }
            answer = chat(roomy_live, **body).json()
            assert "choices" in answer, answer
            for result in answer["choices"]:
                assert result["finish_reason"] == "tool_calls", result
                assert len(result["message"]["tool_calls"]) == 1
                assert result["message"]["content"] is None
                assert_valid_calls(result["message"]["tool_calls"], names)


def test_parallel_tool_calls(roomy_live: LiveServer) -> None:
    counts = []
    for seed in range(6):
        answer = chat(roomy_live, tool_choice="required", seed=seed, temperature=1.0, max_tokens=300).json()
        result = answer["choices"][0]
        if result["finish_reason"] == "tool_calls":
            assert_valid_calls(result["message"]["tool_calls"], set(SCHEMAS))
            counts.append(len(result["message"]["tool_calls"]))
    assert counts and max(counts) > 1, counts


def stream(roomy_live: LiveServer, **body: Any) -> list[dict[str, Any]]:
    payload = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "stream": True, **body}
    with httpx.stream("POST", f"{roomy_live.url}/v1/chat/completions", json=payload, timeout=120) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_valid_calls(roomy_live: LiveServer, choice: Any) -> None:
    chunks = stream(roomy_live, tool_choice=choice, temperature=1.0, seed=3)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for result in chunk["choices"]:
            assert result["delta"].get("content") in (None, "")
            for piece in result["delta"].get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
                if piece.get("id"):
                    assert "id" not in call, "the id comes once, in a call's first delta"
                    call.update(id=piece["id"], type=piece["type"])
                    call["function"]["name"] = piece["function"]["name"]
                call["function"]["arguments"] += piece["function"].get("arguments") or ""
            finish = result["finish_reason"] or finish
    assert finish == "tool_calls"
    assert_valid_calls([calls[i] for i in sorted(calls)], set(SCHEMAS))


def test_named_calls_stream_their_arguments_as_they_are_generated(roomy_live: LiveServer) -> None:
    chunks = stream(
        roomy_live, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0
    )
    pieces = [p for c in chunks for r in c["choices"] for p in r["delta"].get("tool_calls") or []]
    assert len(pieces) > 2 and pieces[0]["id"] and all(p.get("id") is None for p in pieces[1:])


STRICT_TOOLS: list[dict[str, Any]] = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"]
)
def test_streamed_required_calls_assemble_to_the_answer(
    client: openai.OpenAI, sampling: dict[str, Any]
) -> None:
    """The SDK's own stream accumulation joins the streamed calls into the non-streamed answer's calls;
    the arguments come in more than one chunk."""
    common: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": STRICT_TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        **sampling,
    }
    whole = client.chat.completions.create(**common).choices[0]
    fragments = 0
    with client.chat.completions.stream(**common) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                fragments += 1
        streamed = stream.get_final_completion().choices[0]
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert not streamed.message.content  # no markup as content
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]  # type: ignore[union-attr]
    got = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]
    assert got == expected and expected
    assert fragments > 1


def first_call(client: openai.OpenAI, messages: list[Any], streamed: bool) -> tuple[str, str, str]:
    """The model's one forced call (id, name, arguments), read with the SDK's types."""
    common: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "seed": 1,
        "max_tokens": 80,
    }
    if not streamed:
        answer = client.chat.completions.create(**common)
        assert answer.choices[0].finish_reason == "tool_calls"
        calls = answer.choices[0].message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function"
        function = calls[0].function  # type: ignore[union-attr]
        return calls[0].id, function.name, function.arguments
    call_id, name, arguments, finish = "", "", "", None
    for chunk in client.chat.completions.create(**common, stream=True):
        for result in chunk.choices:
            for piece in result.delta.tool_calls or []:
                call_id = piece.id or call_id
                name = (piece.function.name if piece.function else None) or name
                arguments += (piece.function.arguments if piece.function else None) or ""
            finish = result.finish_reason or finish
    assert finish == "tool_calls"
    return call_id, name, arguments


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_an_agent_loop_with_the_sdk_types(client: openai.OpenAI, streamed: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    call_id, name, arguments = first_call(client, messages, streamed)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps({"forecast": "sunny"})})
    if streamed:
        text = ""
        for chunk in client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, stream=True
        ):
            for result in chunk.choices:
                assert not result.delta.tool_calls
                text += result.delta.content or ""
        assert text
    else:
        answer = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
        )
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_the_builtin_format_renders_tools_calls_and_results(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    plan = plan_tools(body, tokenizer.chat_template)
    assert plan is not None and plan.mode == "auto" and plan.parser == "hermes"
    history = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
                ],
            }
        ),
        ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]
    messages, variables = template_messages(history, plan, tokenizer.chat_template)
    assert variables == {}
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert (
        messages[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    text = tokenizer.apply_chat_template(messages)
    assert "<tool_call>" in text and "<tool_response>" in text


def test_a_template_with_tool_support_gets_them_itself() -> None:
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}.{% endfor %}"
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    plan = plan_tools(body, template)
    call = {"id": "c", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = [ChatMessage.model_validate({"role": "assistant", "tool_calls": [call]})]
    messages, variables = template_messages(history, plan, template)
    assert [t["function"]["name"] for t in variables["tools"]] == ["get_weather", "get_time"]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


@pytest.mark.parametrize(
    ("choice", "hermes_template", "llama_template"),
    [("auto", "hermes", "llama3_json"), ("hermes", "hermes", "hermes"), ("llama3_json",) * 3],
)
def test_the_tool_call_parser_flag_chooses_the_parser(
    choice: ParserChoice, hermes_template: str, llama_template: str
) -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    llama = "{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    for template, expected in (("{{ messages }}", hermes_template), (llama, llama_template)):
        plan = plan_tools(body, template, choice)
        assert plan is not None and plan.parser == expected
    args = build_parser().parse_args(["serve", "--model", "m", "--tool-call-parser", choice])
    assert args.tool_call_parser == choice


def test_an_unknown_tool_call_parser_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err


def auto_plan(parser: str = "hermes") -> ToolPlan:
    return ToolPlan("auto", [Tool.model_validate(t) for t in TOOLS], parallel=True, parser=parser)  # type: ignore[arg-type]


def test_auto_output_is_parsed_per_family() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, calls = auto_plan().parse(text)
    assert content == "Let me check.\n" and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {"zone": "UTC"}
    assert auto_plan().parse("no calls here") == ("no calls here", [])
    assert auto_plan().parse("<tool_call>{broken") == ("<tool_call>{broken", [])
    llama = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'
    content, calls = auto_plan("llama3_json").parse(llama)
    assert content is None and json.loads(calls[0].function.arguments) == {"city": "Oslo", "days": 2}


def assembled(deltas: list[Any]) -> tuple[str, list[tuple[str, str, str]]]:
    """Streamed deltas joined as a client joins them: content, and (id, name, arguments) per call."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index not in calls and piece.function.arguments == ""
                calls[piece.index] = [piece.id, piece.function.name, ""]
            else:
                assert piece.function.name is None
            calls[piece.index][2] += piece.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def test_an_auto_stream_sends_content_then_calls_piece_by_piece() -> None:
    text = (
        'Sure <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "note": "a \\"} {["}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    stream = ToolCallStream(auto_plan())
    per_feed = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    deltas = [d for feed in per_feed for d in feed] + stream.finish()
    content, calls = assembled(deltas)
    assert content == "Sure "  # the tag and the calls never go out as content
    arguments = [
        a for feed in per_feed for d in feed for p in d.tool_calls or [] for a in [p.function.arguments]
    ]
    assert sum(1 for a in arguments if a) > 4, "arguments come in pieces as they are generated"
    whole_content, whole_calls = auto_plan().parse(text)
    assert whole_content == content
    assert [(name, args) for _, name, args in calls] == [
        (c.function.name, c.function.arguments) for c in whole_calls
    ]
    assert json.loads(calls[0][2]) == {"zone": "CET", "note": 'a "} {['}
    assert [c.id for c in stream.calls] == [c[0] for c in calls]


def test_a_stream_holds_back_only_what_could_begin_a_tag() -> None:
    stream = ToolCallStream(auto_plan())
    sent = [d.content for piece in ["Sure", " <tool", "s are"] for d in stream.feed(piece)]
    assert sent == ["Sure", " ", "<tools are"]
    plain = ToolCallStream(auto_plan())
    assert [d.content for d in plain.feed("a <b") + plain.finish()] == ["a <b"]


def test_text_that_is_not_calls_goes_out_as_content_at_the_end() -> None:
    broken = ToolCallStream(auto_plan())
    text = "Hm <tool_call>{broken"
    assert assembled(broken.feed(text) + broken.finish()) == (text, [])
    llama = ToolCallStream(auto_plan("llama3_json"))
    assert assembled(llama.feed("The answer {is} 4") + llama.finish()) == ("The answer {is} 4", [])
    cut = ToolPlan("required", [Tool.model_validate(t) for t in TOOLS], parallel=True)
    assert cut.parse('[{"parameters": {"zone": "U') == ('[{"parameters": {"zone": "U', [])


def test_llama3_calls_stream_and_keys_may_come_in_any_order() -> None:
    text = (
        '<|python_tag|>{"parameters": {"city": "Oslo", "days": 2}, "name": "get_weather"}; '
        '{"name": "get_time", "parameters": {}}'
    )
    stream = ToolCallStream(auto_plan("llama3_json"))
    deltas = [d for i in range(0, len(text), 5) for d in stream.feed(text[i : i + 5])] + stream.finish()
    content, calls = assembled(deltas)
    assert content == ""
    assert [(name, json.loads(args)) for _, name, args in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "bad"}},
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "bad", "parameters": {"type": "string", "pattern": "(["}},
                    }
                ],
            },
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests_are_400(roomy_live: LiveServer, change: dict[str, Any], param: str) -> None:
    response = chat(roomy_live, **change)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
    ids=["image", "audio", "file"],
)
def test_image_audio_and_file_parts_are_400_naming_the_field(roomy_live: LiveServer, part: Any) -> None:
    content = [{"type": "text", "text": "What is it?"}, part]
    response = chat(roomy_live, messages=[{"role": "user", "content": content}], tools=None)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("messages") and part["type"] in error["message"], error
