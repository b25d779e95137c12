"""The engine's warm-up: one full prefill step (as long as the step budget, the model and the pool allow),
then a decode step, leaving the engine idle."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.warmup import WARMUP_OUTPUT_TOKENS, warm_up, warmup_prompt_len


@pytest.mark.parametrize(
    ("budget", "max_model_len", "blocks", "expected"),
    [
        (2048, 8192, 1000, 2048),  # a full step
        (2048, 512, 1000, 512 - WARMUP_OUTPUT_TOKENS),  # the model is shorter
        (2048, 8192, 9, 8 * 16 - WARMUP_OUTPUT_TOKENS),  # the pool is smaller (one block spare)
        (2048, 8192, 1, 1),  # never less than one token
    ],
)
def test_warmup_prompt_fills_one_step_within_model_and_pool(
    budget: int, max_model_len: int, blocks: int, expected: int
) -> None:
    engine: Any = SimpleNamespace(
        config=EngineConfig(max_num_batched_tokens=budget, block_size=16),
        max_model_len=max_model_len,
        num_kv_blocks=blocks,
    )
    assert warmup_prompt_len(engine) == expected


def test_warm_up_runs_a_full_step_and_leaves_the_engine_idle(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(
        tiny_llama_dir, EngineConfig(num_kv_blocks=40, max_num_batched_tokens=256, device="cpu")
    )
    try:
        warm_up(engine)
        stats = engine.stats()
        assert stats.num_prompt_tokens == 256
        assert stats.num_generation_tokens == WARMUP_OUTPUT_TOKENS
        assert stats.num_steps == WARMUP_OUTPUT_TOKENS  # the whole prompt in one step, then one decode
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()
