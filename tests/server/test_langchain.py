"""LangChain's ChatOpenAI, unchanged, against the server: `with_structured_output` (a pydantic model, as
json_schema and as a function call) and `bind_tools` with a forced call, as application code uses them.
The model is the random-weight test model: the grammar makes every answer valid, whatever it would say."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")

LiveServer = Any  # tests/server/conftest.py's LiveServer
MODEL_NAME = "tiny"  # the name the live servers of tests/server/conftest.py serve


class Forecast(BaseModel):
    """A weather forecast."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class GetWeather(BaseModel):
    """Get the weather for a city."""

    city: str = Field(max_length=20)


def chat_model(roomy_live: LiveServer) -> Any:
    return langchain_openai.ChatOpenAI(
        base_url=f"{roomy_live.url}/v1",
        api_key="unused",
        model=MODEL_NAME,
        max_tokens=80,
        temperature=0,
        max_retries=0,
        timeout=120,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_model(roomy_live: LiveServer, method: str) -> None:
    structured = chat_model(roomy_live).with_structured_output(Forecast, method=method)
    answer = structured.invoke("Forecast for Paris?")
    assert isinstance(answer, Forecast)
    assert 1 <= answer.days <= 7 and answer.unit in ("celsius", "fahrenheit")


def test_bind_tools_with_a_forced_call_returns_a_valid_tool_call(roomy_live: LiveServer) -> None:
    bound = chat_model(roomy_live).bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])
