"""Schemathesis fuzzes every operation of the served OpenAPI schema, valid and invalid inputs: never a 5xx."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

EXAMPLES_PER_MODE = 8
# Generation length is not what is fuzzed here; cap it so the run stays short.
MAX_TOKENS_CAP = 4
# The demo's real run takes minutes by design (the whole demo workload, twice); tests/sim covers it.
SKIPPED = {"POST /v1/demo/run"}


def cap_generation(case: Any) -> None:
    """Keep generated requests small: few tokens, few choices, few prompts."""
    if not isinstance(case.body, dict):
        return
    if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
        case.body["n"] = 2
    if isinstance(case.body.get("prompt"), list) and len(case.body["prompt"]) > 4:
        case.body["prompt"] = case.body["prompt"][:4]
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(case.body.get(key), int) and case.body[key] > MAX_TOKENS_CAP:
            case.body[key] = MAX_TOKENS_CAP
    if "messages" in case.body and "max_tokens" not in case.body:
        case.body["max_tokens"] = MAX_TOKENS_CAP


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_input_makes_a_server_error(live: Any, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_dict(httpx.get(f"{live.url}/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {operation.label for operation in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "GET /metrics"} <= labels
    for operation in operations:
        if operation.label in SKIPPED:
            continue

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_MODE,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: Any) -> None:
            cap_generation(case)
            case.call_and_validate(base_url=live.url, checks=[not_a_server_error], timeout=60)

        try:
            fuzz()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to make invalid (no inputs)
    assert live.engine.num_in_flight == 0
