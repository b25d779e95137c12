"""Contiguous vs paged KV memory on the virtual clock: the two runs side by side (the contiguous allocator's
own invariants are in tests/engine/test_contiguous_kv.py)."""

from __future__ import annotations

import pytest

from inflight.sim.cost_model import DEFAULT_COST_MODEL
from inflight.sim.memory import (
    DEFAULT_BUDGET_MIB,
    MAX_BUDGET_MIB,
    MIN_BUDGET_MIB,
    MemoryComparison,
    Reserve,
    simulate_memory,
)
from inflight.sim.workload import demo_workload

RESERVES: tuple[Reserve, ...] = ("max_model_len", "prompt_plus_max_tokens")


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, Reserve], MemoryComparison]:
    budgets = (MIN_BUDGET_MIB, 128, DEFAULT_BUDGET_MIB, 512, MAX_BUDGET_MIB)
    return {(b, r): simulate_memory(b, r, DEFAULT_COST_MODEL) for b in budgets for r in RESERVES}


def test_both_allocators_stay_within_the_budget_and_hold_what_they_write(
    runs: dict[tuple[int, Reserve], MemoryComparison],
) -> None:
    for (budget, _), run in runs.items():
        capacity = budget * 1024 * 1024 // run.kv_bytes_per_token
        for result in (run.contiguous, run.paged):
            assert result.capacity_tokens <= capacity
            for step in result.steps:
                assert step.reserved_tokens <= result.capacity_tokens
                assert step.written_tokens <= step.reserved_tokens
                assert step.in_flight + step.waiting <= run.workload.num_requests
            assert result.steps[-1].in_flight == 0 and result.steps[-1].reserved_tokens == 0
        assert run.contiguous.preemptions == 0


def test_paged_holds_at_least_as_many_requests_in_flight_and_wastes_less(
    runs: dict[tuple[int, Reserve], MemoryComparison],
) -> None:
    for run in runs.values():
        assert run.paged.mean_in_flight >= run.contiguous.mean_in_flight
        assert run.paged.peak_in_flight >= run.contiguous.peak_in_flight
        assert run.paged.waste_share < run.contiguous.waste_share
        assert run.paged.makespan_s <= run.contiguous.makespan_s


def test_reserving_max_model_len_admits_budget_over_max_model_len_requests(
    runs: dict[tuple[int, Reserve], MemoryComparison],
) -> None:
    for (_, reserve), run in runs.items():
        if reserve == "max_model_len":
            assert run.contiguous.peak_in_flight == run.contiguous.capacity_tokens // run.max_model_len
    default = runs[(DEFAULT_BUDGET_MIB, "max_model_len")]
    assert default.in_flight_ratio >= 2.0
    assert f"{default.in_flight_ratio:.1f}x" in default.summary
    # Reserving only what each request needs wastes less than reserving max_model_len.
    exact = runs[(DEFAULT_BUDGET_MIB, "prompt_plus_max_tokens")]
    assert exact.contiguous.waste_share < default.contiguous.waste_share
    assert exact.contiguous.mean_in_flight > default.contiguous.mean_in_flight


def test_every_request_is_served_and_the_budget_is_checked() -> None:
    run = simulate_memory(DEFAULT_BUDGET_MIB, "max_model_len", DEFAULT_COST_MODEL)
    output_tokens = sum(request.output_tokens for request in demo_workload())
    for result in (run.contiguous, run.paged):
        assert result.throughput_tokens_per_s == pytest.approx(output_tokens / result.makespan_s)
        assert result.makespan_s == result.steps[-1].end_s
    for budget in (MIN_BUDGET_MIB - 1, MAX_BUDGET_MIB + 1):
        with pytest.raises(ValueError, match="budget_mib"):
            simulate_memory(budget, "max_model_len", DEFAULT_COST_MODEL)
