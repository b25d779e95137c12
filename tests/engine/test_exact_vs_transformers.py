"""Greedy outputs equal transformers' `generate` token for token (float32), under every batching regime.

16 prompts of mixed lengths (some sharing a 2-3 block prefix), 8..24 new tokens each, for the llama and
qwen2 tiny checkpoints; the transformers reference is computed once per checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.scheduler import StepRecord
from inflight.engine.sequence import SamplingParams

from support.reference import hf_greedy

NUM_PROMPTS = 16
BLOCK_SIZE = 8


def make_prompts(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(3, vocab_size) for _ in range(20)]
    prompts, max_tokens = [], []
    for i in range(NUM_PROMPTS):
        length = rng.randrange(2, 60)
        tail = [rng.randrange(3, vocab_size) for _ in range(length)]
        prompts.append(shared + tail if i % 3 == 0 else tail)
        max_tokens.append(rng.randrange(8, 25))
    return prompts, max_tokens


class Reference:
    def __init__(self, model_dir: Path) -> None:
        from inflight.engine.model.config import ModelConfig

        self.model_dir = model_dir
        vocab = ModelConfig.from_dir(model_dir).vocab_size
        self.prompts, self.max_tokens = make_prompts(vocab)
        self.expected = hf_greedy(model_dir, self.prompts, self.max_tokens)

    def run(self, on_step: Callable[[StepRecord], None] | None = None, **overrides: Any) -> LLMEngine:
        config = EngineConfig(block_size=BLOCK_SIZE, dtype="float32", device="cpu", **overrides)
        engine = LLMEngine(self.model_dir, config)
        engine.scheduler.on_step = on_step
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in self.max_tokens]
        outputs = engine.generate(self.prompts, params)
        got = [o.outputs[0].token_ids for o in outputs]
        for i, (ours, theirs) in enumerate(zip(got, self.expected, strict=True)):
            assert ours == theirs, f"prompt {i} (length {len(self.prompts[i])}) differs"
        assert engine.kv_cache.num_used_blocks == 0
        return engine


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def reference(request: pytest.FixtureRequest) -> Reference:
    model_dir: Path = request.getfixturevalue(f"tiny_{request.param}_dir")
    return Reference(model_dir)


def test_slots_fewer_than_requests(reference: Reference) -> None:
    engine = reference.run(max_num_seqs=4, enable_prefix_caching=False)
    assert engine.stats().num_preemptions == 0


def test_small_kv_pool_forces_preemption(reference: Reference) -> None:
    engine = reference.run(max_num_seqs=8, num_kv_blocks=24, enable_prefix_caching=False)
    assert engine.stats().num_preemptions > 0


def test_prefix_caching_hits(reference: Reference) -> None:
    engine = reference.run(max_num_seqs=4, enable_prefix_caching=True)
    assert engine.stats().num_prefix_cache_hits >= 2 * BLOCK_SIZE


def test_chunked_prefill_budget_below_longest_prompt(reference: Reference) -> None:
    longest = max(len(p) for p in reference.prompts)
    budget = longest // 3
    records: list[StepRecord] = []
    engine = reference.run(max_num_seqs=6, max_num_batched_tokens=budget, on_step=records.append)
    assert engine.stats().num_preemptions == 0  # so each sequence's scheduled tokens are computed once
    assert all(sum(n for _, n in record.scheduled) <= budget for record in records)
    # The longest prompt was prefilled in chunks: a sequence computes (prompt - cached) tokens in its
    # prefill steps and then one token per decode step, max_tokens - 1 of them.
    index = max(range(NUM_PROMPTS), key=lambda i: len(reference.prompts[i]))
    steps = [n for record in records for seq_id, n in record.scheduled if seq_id == f"generate-1-{index}"]
    prefill_steps = len(steps) - (reference.max_tokens[index] - 1)
    assert prefill_steps >= 2, f"the {longest}-token prompt was prefilled in one step under a {budget} budget"


def test_static_scheduler_admits_nothing_while_a_batch_runs(reference: Reference) -> None:
    records: list[StepRecord] = []
    reference.run(max_num_seqs=5, scheduler="static", max_num_batched_tokens=40, on_step=records.append)
    running: set[str] = set()
    batches = []
    for record in records:
        if record.admitted:
            assert not running, f"step {record.step} admitted {record.admitted} while {sorted(running)} ran"
            batches.append(len(record.admitted))
        running |= set(record.admitted)
        running -= set(record.finished) | set(record.failed) | set(record.preempted)
    assert batches == [5, 5, 5, 1]
