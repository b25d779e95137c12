"""The memory panel run for real: the demo's requests through the live engine's model, its KV pool cut
to the budget, once with contiguous reservations and once with paged blocks, on the wall clock.

Each allocator gets its own `LLMEngine` (continuous scheduler, `EngineConfig.kv_allocator`) with the
settings the memory simulation uses and as many KV blocks as the budget buys there (the budget's tokens
of the stated 8B model, whatever the live model's bytes per token), sharing the live engine's weights.
So the real run makes the simulated scheduling decisions (same engine steps, same requests in flight at
each step); only the step times are measured instead of priced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from inflight.engine.warmup import warm_up
from inflight.sim.live import LiveProgress, demo_engine_config, run_demo_requests
from inflight.sim.memory import (
    ALLOCATORS,
    Allocator,
    AllocatorResult,
    MemoryComparison,
    MemoryStep,
    Reserve,
    allocator_result,
    budget_blocks,
    compare_memory,
    memory_settings,
    memory_step,
)
from inflight.sim.simulator import DemoEngineSettings
from inflight.sim.workload import DemoRequest, demo_workload

if TYPE_CHECKING:
    from inflight.engine.engine import LLMEngine


def run_live_allocator(
    live_engine: LLMEngine,
    allocator: Allocator,
    num_blocks: int,
    reserve: Reserve,
    requests: Sequence[DemoRequest],
    settings: DemoEngineSettings,
    tracker: LiveProgress | None = None,
) -> AllocatorResult:
    """`requests` through a fresh engine over `allocator` with `num_blocks` KV blocks; what memory held
    after each step, measured."""
    from inflight.engine.engine import LLMEngine

    config = demo_engine_config(
        "continuous",
        settings,
        live_engine.config,
        num_kv_blocks=num_blocks,
        kv_allocator=allocator,
        contiguous_reserve=reserve,
    )
    engine = LLMEngine(live_engine.model_dir, config, share_model_of=live_engine)
    try:
        warm_up(engine)
        steps: list[MemoryStep] = []
        if tracker is not None:
            tracker.allocator = allocator
        run_demo_requests(
            engine,
            requests,
            lambda start_s, end_s, _: steps.append(
                memory_step(start_s, end_s, engine.scheduler, engine.kv_cache)
            ),
            allocator,
            tracker=tracker,
        )
        return allocator_result(
            allocator,
            num_blocks * settings.block_size,
            engine.scheduler.num_preemptions_total,
            requests,
            steps,
        )
    finally:
        engine.close()


def run_live_memory(
    live_engine: LLMEngine,
    budget_mib: int,
    reserve: Reserve,
    tracker: LiveProgress | None = None,
    requests: Sequence[DemoRequest] | None = None,
) -> MemoryComparison:
    """What `POST /v1/demo/memory/run` answers: both allocators on the live engine's model and device."""
    workload = list(requests) if requests is not None else demo_workload()
    settings = memory_settings()
    num_blocks = budget_blocks(budget_mib, settings.block_size)
    if tracker is not None:
        tracker.requests_total = len(workload)
    results = {
        allocator: run_live_allocator(
            live_engine, allocator, num_blocks, reserve, workload, settings, tracker
        )
        for allocator in ALLOCATORS
    }
    live_model = f"{live_engine.model_dir.name} in {str(live_engine.dtype).removeprefix('torch.')}"
    return compare_memory("measured", budget_mib, reserve, settings, workload, results, None, live_model)
