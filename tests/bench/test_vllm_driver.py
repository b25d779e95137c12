"""The vLLM driver (run in vLLM's own virtualenv) against a stand-in `vllm` package: what it asks of vLLM
and in which order, so that the timed run starts from the same state as inflight's."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from inflight.bench import vllm_driver


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion]


class _FakeLLM:
    """Records the calls the driver makes; `reset_ok` is what reset_prefix_cache answers."""

    calls: ClassVar[list[str]] = []
    reset_ok: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        self.calls.append("init")

    def generate(self, prompts: list[dict[str, Any]], params: Any, use_tqdm: bool) -> list[_Output]:
        self.calls.append(f"generate {len(prompts)}")
        lengths = params if isinstance(params, list) else [params] * len(prompts)
        return [_Output([_Completion([7] * p.max_tokens)]) for p in lengths]

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return self.reset_ok


@dataclass
class _SamplingParams:
    max_tokens: int
    temperature: float
    ignore_eos: bool


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type[_FakeLLM]:
    vllm = types.ModuleType("vllm")
    vllm.__dict__.update(__version__="0.0-fake", LLM=_FakeLLM, SamplingParams=_SamplingParams)
    inputs = types.ModuleType("vllm.inputs")
    inputs.__dict__.update(TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids})
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(_FakeLLM, "calls", [])
    monkeypatch.setattr(_FakeLLM, "reset_ok", True)
    return _FakeLLM


def _spec(tmp_path: Path) -> tuple[str, str]:
    spec = {
        "model_dir": "unused",
        "dtype": "float32",
        "max_slots": 4,
        "max_num_batched_tokens": 64,
        "max_model_len": 64,
        "requests": [{"prompt": [1, 2, 3], "output_len": 5}, {"prompt": [4, 5], "output_len": 2}],
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return str(spec_path), str(tmp_path / "result.json")


def test_the_warm_up_prompt_is_dropped_from_the_prefix_cache_before_the_timed_run(
    fake_vllm: type[_FakeLLM], tmp_path: Path
) -> None:
    spec_path, result_path = _spec(tmp_path)
    vllm_driver.main(spec_path, result_path)
    # The warm-up is request 0's prompt: left cached, the timed run would skip that prompt's prefill.
    assert fake_vllm.calls == ["init", "generate 1", "reset_prefix_cache", "generate 2"]
    result = json.loads(Path(result_path).read_text())
    assert result["outputs"] == [[7] * 5, [7] * 2]
    assert result["vllm_version"] == "0.0-fake"


def test_a_prefix_cache_that_cannot_be_emptied_stops_the_run(
    fake_vllm: type[_FakeLLM], tmp_path: Path
) -> None:
    fake_vllm.reset_ok = False
    spec_path, result_path = _spec(tmp_path)
    with pytest.raises(RuntimeError, match="prefix cache"):
        vllm_driver.main(spec_path, result_path)
    assert "generate 2" not in fake_vllm.calls
    assert not Path(result_path).exists()
