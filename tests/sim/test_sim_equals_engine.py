"""The simulator runs the real algorithms: its step sequence equals the real engine's, step for step.

The real `LLMEngine` runs the tiny model (greedy, ignore_eos, the same output lengths) with the
simulator's settings; both report every step's decisions through the scheduler's `on_step` hook.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.sim.cost_model import DEFAULT_COST_MODEL
from inflight.sim.live import LiveProgress, run_live_policy
from inflight.sim.simulator import DemoEngineSettings, simulate_policy
from inflight.sim.timeline import Policy
from inflight.sim.workload import small_workload


@pytest.mark.parametrize("policy", ["static", "continuous"])
@pytest.mark.parametrize(
    "settings",
    [
        DemoEngineSettings(slots=2),
        # A 16-token budget chunks every prompt over several steps.
        DemoEngineSettings(slots=3, max_num_batched_tokens=16),
    ],
    ids=["2-slots", "3-slots-chunked-prefill"],
)
def test_simulated_steps_equal_the_real_engine_steps(
    tiny_llama_dir: Path, policy: Policy, settings: DemoEngineSettings
) -> None:
    requests = small_workload()
    tracker = LiveProgress(requests_total=len(requests))
    real = run_live_policy(tiny_llama_dir, policy, requests, settings, tracker=tracker)
    simulated = simulate_policy(policy, requests, settings, DEFAULT_COST_MODEL)
    # What the demo page shows while a real run goes on, at its end.
    assert (tracker.policy, tracker.requests_done) == (policy, len(requests))
    assert tracker.output_tokens == sum(r.output_tokens for r in requests) and tracker.elapsed_s > 0

    assert simulated.steps == real.recorder.steps
    # Not trivially equal: requests were admitted over several steps and finished in a mixed order.
    admitting_steps = [step.step for step in simulated.steps if step.admitted]
    finish_order = [rid for step in simulated.steps for rid in step.finished]
    assert len(admitting_steps) >= 2
    assert finish_order != [r.request_id for r in requests]
    assert sorted(finish_order) == sorted(r.request_id for r in requests)


def test_demo_engines_share_the_live_engine_weights(tiny_llama_dir: Path) -> None:
    from inflight.engine.config import EngineConfig
    from inflight.engine.engine import LLMEngine
    from inflight.sim.live import demo_engine_config

    live = LLMEngine(tiny_llama_dir, EngineConfig(num_kv_blocks=16, max_model_len=256))
    config = demo_engine_config("static", DemoEngineSettings(slots=2), live.config)
    demo = LLMEngine(tiny_llama_dir, config, share_model_of=live)
    assert demo.model is live.model and demo.tokenizer is live.tokenizer
    # Its own scheduler and KV cache: a demo run never touches the live engine's blocks.
    assert demo.kv_cache is not live.kv_cache and demo.scheduler.policy == "static"
    assert demo.runner.kv_caches[0][0].data_ptr() != live.runner.kv_caches[0][0].data_ptr()
