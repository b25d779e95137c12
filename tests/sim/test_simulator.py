"""The simulator: the real schedulers on a virtual clock, and what they show on the demo workload."""

from __future__ import annotations

import itertools

import pytest

from inflight.engine.sequence import Sequence
from inflight.sim.cost_model import DEFAULT_COST_MODEL, CostModel
from inflight.sim.simulator import (
    DemoEngineSettings,
    build_scheduler,
    sampling_params,
    simulate,
    simulate_policy,
)
from inflight.sim.timeline import PolicyResult
from inflight.sim.workload import NUM_REQUESTS, demo_workload, small_workload

UNIT_COST = CostModel(fixed_s=1.0, per_token_s=0.0, source="one second per step")


def test_workload_is_fixed_and_has_the_demo_shape() -> None:
    requests = demo_workload()
    assert requests == demo_workload()
    assert len(requests) == NUM_REQUESTS
    long = [r for r in requests if r.long]
    short = [r for r in requests if not r.long]
    assert len(long) == 6 and len(short) == 24
    assert all(150 <= r.output_tokens <= 300 for r in long)
    assert all(8 <= r.output_tokens <= 32 for r in short)
    assert all(16 <= r.prompt_tokens <= 128 for r in requests)
    # At 8 slots every static batch of 8 holds one long request at least.
    assert all(any(r.long for r in requests[i : i + 8]) for i in range(0, NUM_REQUESTS, 8))


def test_continuous_throughput_is_at_least_twice_static_at_8_slots() -> None:
    comparison = simulate(8, DEFAULT_COST_MODEL)
    static, continuous = comparison.static, comparison.continuous
    print(f"\n8 slots: {comparison.summary}")
    assert comparison.throughput_ratio >= 2.0
    # Why: static batches wait for their long member, so most of their slot-time is idle.
    assert static.idle_slot_fraction > 0.6 > continuous.idle_slot_fraction
    # Continuous can do no better than its longest request's decode steps.
    longest = max(r.output_tokens for r in demo_workload())
    assert longest <= continuous.steps < static.steps


@pytest.mark.parametrize("slots", [1, 3, 8, 32])
def test_every_request_finishes_with_consistent_times(slots: int) -> None:
    comparison = simulate(slots, UNIT_COST)
    for result in (comparison.static, comparison.continuous):
        assert result.output_tokens == sum(r.output_tokens for r in demo_workload())
        for request in result.requests:
            assert 0 <= request.admit_s < request.first_token_s <= request.finish_s
            # One decode step per output token after the first: at one second per step, exactly.
            assert request.finish_s - request.first_token_s == request.output_tokens - 1
            assert all(seg.slot < slots for seg in request.segments)
        _assert_lanes_never_overlap(result)
        assert result.makespan_s == result.steps  # one second per step
        assert result.throughput_tokens_per_s == pytest.approx(result.output_tokens / result.makespan_s)


def _assert_lanes_never_overlap(result: PolicyResult) -> None:
    by_slot: dict[int, list[tuple[float, float]]] = {}
    for request in result.requests:
        for seg in request.segments:
            by_slot.setdefault(seg.slot, []).append((seg.start_s, seg.end_s))
    for spans in by_slot.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start


def test_static_admits_only_when_nothing_runs_and_continuous_refills_at_once() -> None:
    settings = DemoEngineSettings(slots=4)
    static = simulate_policy("static", demo_workload(), settings, UNIT_COST)
    running: set[str] = set()
    for step in static.steps:
        if step.admitted:
            assert not running
        running |= set(step.admitted)
        running -= set(step.finished)
    continuous = simulate_policy("continuous", demo_workload(), settings, UNIT_COST)
    running = set()
    waiting = len(demo_workload())
    for step in continuous.steps:
        # A slot freed by the previous step is refilled by this one while requests wait.
        assert len(running) + len(step.admitted) == min(settings.slots, len(running) + waiting)
        waiting -= len(step.admitted)
        running |= set(step.admitted)
        running -= set(step.finished)


def test_first_token_time_matches_the_scheduler_sampling_step() -> None:
    """The recorder infers first tokens from scheduled prompt tokens; check it against the scheduler."""
    requests = small_workload()
    settings = DemoEngineSettings(slots=2, max_num_batched_tokens=16)  # forces chunked prefill
    recorder = simulate_policy("continuous", requests, settings, UNIT_COST)
    first_sampling_step: dict[str, int] = {}
    scheduler = build_scheduler("continuous", settings)
    for request in requests:
        scheduler.add(Sequence(request.request_id, list(request.prompt_token_ids), sampling_params(request)))
    outputs = {r.request_id: r.output_token_ids for r in requests}
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        sampled = {}
        for item in out.sampling:
            first_sampling_step.setdefault(item.seq.request_id, out.step)
            sampled[item.seq.seq_id] = [outputs[item.seq.request_id][item.seq.num_output_tokens]]
        scheduler.update(out, sampled)
    result = recorder.result()
    for request in result.requests:
        assert request.first_token_s == first_sampling_step[request.request_id] + 1
