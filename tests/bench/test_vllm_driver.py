"""The vLLM system (vllm_cpu.run and the driver it runs in vLLM's own virtualenv) against a stand-in `vllm`
package: what it asks of vLLM and in which order, so that the timed run starts from the same state as
inflight's."""

from __future__ import annotations

import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from inflight.bench import vllm_cpu, vllm_driver
from inflight.bench.system import BenchSettings
from inflight.bench.workload import BenchRequest, warmup_prompt


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion]


class _FakeLLM:
    """Records the prompts of each generate call the driver makes."""

    calls: ClassVar[list[list[list[int]]]] = []

    def __init__(self, **kwargs: Any) -> None:
        pass

    def generate(self, prompts: list[dict[str, Any]], params: Any, use_tqdm: bool) -> list[_Output]:
        self.calls.append([p["prompt_token_ids"] for p in prompts])
        lengths = params if isinstance(params, list) else [params] * len(prompts)
        return [_Output([_Completion([7] * p.max_tokens)]) for p in lengths]


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
    return _FakeLLM


def test_vllm_is_warmed_up_on_a_prompt_no_timed_request_starts_with(
    fake_vllm: type[_FakeLLM], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vllm_cpu.run writes the spec, the driver reads it (called in-process here instead of in vLLM's
    virtualenv): the warm-up generate gets workload.warmup_prompt, the timed one every request in order."""
    requests = [BenchRequest([11, 12, 13], 5), BenchRequest([14, 15], 2)]

    def run_driver(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        vllm_driver.main(command[3], command[4])
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(vllm_cpu.subprocess, "run", run_driver)
    settings = BenchSettings(
        model_dir=tmp_path,
        requests=requests,
        max_slots=4,
        dtype="float32",
        vllm_python=Path("python"),
        max_num_batched_tokens=64,
        threads=1,
    )
    run = vllm_cpu.SYSTEM.run(settings)
    # Warmed up on request 0's own prompt, vLLM's prefix cache let the timed run skip that prompt's prefill.
    assert fake_vllm.calls == [[warmup_prompt(requests)], [[11, 12, 13], [14, 15]]]
    assert warmup_prompt(requests)[0] not in (11, 14)
    assert run.outputs == [[7] * 5, [7] * 2]
    assert run.config["vllm_version"] == "0.0-fake"
