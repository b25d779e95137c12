"""Freed activation memory stays in the process: repeated prefill steps on CPU stop page-faulting it in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.engine.cpu import allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

# Runs in a fresh process (malloc's settings are process-wide): the same prefill-only batch four times,
# printing each round's minor page faults.
ROUNDS_SCRIPT = """
import json, resource, sys
from inflight import LLM, SamplingParams
from inflight.engine.cpu import allocator
llm = LLM(sys.argv[1], max_slots=16, block_size=16, max_num_batched_tokens=2048, dtype="float32")
prompts = [[(7 * i + j) % 500 + 10 for j in range(200)] for i in range(10)]
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(prompts, params)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
llm.close()
print(json.dumps({"retained": allocator.retain_freed_memory(), "faults": faults}))
"""


def _fault_rounds(model_dir: Path, extra_env: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_SETTINGS} | extra_env
    result = subprocess.run(
        [sys.executable, "-c", ROUNDS_SCRIPT, str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    parsed: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def test_engine_keeps_activation_memory_between_steps(small_llama_dir: Path) -> None:
    # 2,000 prompt tokens of `small` in float32: about 20 MB of activations per step. Before the engine
    # kept them, every step after the first faulted 1,500-7,500 pages in again.
    run = _fault_rounds(small_llama_dir, {})
    assert run["retained"] is True
    faults = run["faults"]
    assert isinstance(faults, list)
    assert max(faults[1:]) < 200, faults


def test_user_malloc_settings_win(small_llama_dir: Path) -> None:
    run = _fault_rounds(small_llama_dir, {"MALLOC_TOP_PAD_": "131072"})
    assert run["retained"] is False
