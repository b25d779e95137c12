"""Contiguous vs paged KV memory: the demo's 30 requests on one KV memory budget, both ways.

Both runs use the engine's real `ContinuousScheduler` on the virtual clock (the slots panel's
simulator loop and cost model) with more slots than requests, so memory is the only limit; only the
allocator differs:

- contiguous (the engine's `ContiguousKVCache`): each request reserves max_model_len tokens (or its
  prompt + max_tokens) of consecutive blocks up front, as servers before PagedAttention did, and holds
  them until it finishes;
- paged (the engine's `KVCacheManager`): 16-token blocks taken as the request writes them; out of
  blocks, the scheduler preempts the newest request and recomputes it later.

The budget is bytes of KV memory for a stated model (Llama-3.1-8B in bfloat16 by default: 128 KiB a
token, from `sizing.kv_bytes_per_token`), so the slider reads in MiB. The same step records and figures
serve the live run (`sim/live_memory.py`), which measures both allocators on the live engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, Field

from inflight.engine.config import ContiguousReserve, KVAllocatorKind
from inflight.engine.contiguous_kv import build_kv_allocator
from inflight.engine.kv_cache import KVAllocator
from inflight.engine.scheduler import Scheduler, create_scheduler
from inflight.sim.comparison import WorkloadSummary, summarize_workload
from inflight.sim.cost_model import CostModel
from inflight.sim.simulator import MAX_SLOTS, DemoEngineSettings, run_on_virtual_clock
from inflight.sim.workload import DemoRequest, demo_workload
from inflight.sizing import MIB, find_model, kv_bytes_per_token

Reserve = ContiguousReserve
Allocator = KVAllocatorKind
ALLOCATORS: tuple[Allocator, ...] = ("contiguous", "paged")

MEMORY_MODEL = "meta-llama/Llama-3.1-8B"
MEMORY_DTYPE = "bfloat16"
MIN_BUDGET_MIB = 64
MAX_BUDGET_MIB = 1024
DEFAULT_BUDGET_MIB = 256


class MemoryStep(BaseModel):
    start_s: float
    end_s: float
    in_flight: int = Field(description="requests holding KV memory at the end of the step")
    waiting: int = Field(description="requests not admitted yet (or preempted) at the end of the step")
    reserved_tokens: int = Field(description="KV memory held, in tokens")
    written_tokens: int = Field(description="tokens actually in the KV cache")


class AllocatorResult(BaseModel):
    allocator: Allocator
    capacity_tokens: int = Field(description="the budget in tokens of KV memory")
    num_steps: int
    makespan_s: float = Field(description="time until the last request finished")
    throughput_tokens_per_s: float = Field(description="output tokens / makespan")
    mean_in_flight: float = Field(description="requests in flight, averaged over time")
    peak_in_flight: int
    mean_waiting: float = Field(description="requests waiting for memory, averaged over time")
    waste_share: float = Field(description="share of reserved memory-time holding no written token")
    preemptions: int
    steps: list[MemoryStep]


class MemoryComparison(BaseModel):
    kind: Literal["simulated", "measured"] = Field(
        description="'simulated' (virtual clock) or 'measured' (the live engine, its KV pool "
        "cut to the budget's tokens)"
    )
    budget_mib: int
    model: str = Field(description="the model whose KV bytes per token turn the budget into tokens")
    dtype: str
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    reserve: Reserve = Field(description="what the contiguous allocator reserves per request")
    cost_model: CostModel | None = Field(description="the step cost model; None for measured runs")
    live_model: str | None = Field(
        default=None, description="measured runs: the live engine's model folder and dtype"
    )
    workload: WorkloadSummary
    contiguous: AllocatorResult
    paged: AllocatorResult
    in_flight_ratio: float = Field(description="paged / contiguous mean requests in flight")
    throughput_ratio: float = Field(description="paged / contiguous throughput")
    summary: str


def validate_budget(budget_mib: int) -> None:
    if not MIN_BUDGET_MIB <= budget_mib <= MAX_BUDGET_MIB:
        raise ValueError(
            f"budget_mib must be between {MIN_BUDGET_MIB} and {MAX_BUDGET_MIB}, got {budget_mib}"
        )


def token_bytes() -> int:
    shape = find_model(MEMORY_MODEL)
    assert shape is not None, f"{MEMORY_MODEL} left the sizing catalog"
    return kv_bytes_per_token(shape, MEMORY_DTYPE, 1)


def budget_blocks(budget_mib: int, block_size: int) -> int:
    """The KV pool a budget buys, in blocks: the budget's tokens of `MEMORY_MODEL` (the live run cuts the
    live engine's pool to the same number, whatever its own bytes per token)."""
    validate_budget(budget_mib)
    return budget_mib * MIB // token_bytes() // block_size


def memory_step(start_s: float, end_s: float, scheduler: Scheduler, kv_cache: KVAllocator) -> MemoryStep:
    """What memory holds after a step: requests in flight and waiting, blocks held and tokens written."""
    return MemoryStep(
        start_s=start_s,
        end_s=end_s,
        in_flight=scheduler.num_running,
        waiting=scheduler.num_waiting,
        reserved_tokens=kv_cache.stats().num_used_blocks * kv_cache.block_size,
        written_tokens=sum(seq.num_computed_tokens for seq in scheduler.running),
    )


def simulate_allocator(
    allocator: Allocator,
    num_blocks: int,
    reserve: Reserve,
    requests: Sequence[DemoRequest],
    settings: DemoEngineSettings,
    cost_model: CostModel,
) -> AllocatorResult:
    """`requests` through the continuous scheduler over `allocator`; what memory held at each step."""
    scheduler: Scheduler | None = None

    def the_scheduler() -> Scheduler:
        assert scheduler is not None
        return scheduler

    kv_cache = build_kv_allocator(
        allocator,
        num_blocks,
        settings.block_size,
        enable_prefix_caching=False,
        reserve=reserve,
        waiting=lambda: the_scheduler().waiting,
    )
    scheduler = create_scheduler(
        "continuous",
        kv_cache,
        max_num_seqs=settings.slots,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        max_prefill_tokens_while_decoding=settings.max_prefill_tokens_while_decoding,
    )
    steps: list[MemoryStep] = []
    run_on_virtual_clock(
        scheduler,
        requests,
        cost_model,
        lambda start_s, end_s, _: steps.append(memory_step(start_s, end_s, the_scheduler(), kv_cache)),
    )
    return allocator_result(
        allocator, num_blocks * settings.block_size, scheduler.num_preemptions_total, requests, steps
    )


def allocator_result(
    allocator: Allocator,
    capacity_tokens: int,
    preemptions: int,
    requests: Sequence[DemoRequest],
    steps: list[MemoryStep],
) -> AllocatorResult:
    """The figures of one allocator's run from its steps (virtual or wall-clock seconds)."""
    makespan = steps[-1].end_s
    output_tokens = sum(request.output_tokens for request in requests)

    def time_weighted(values: Sequence[float]) -> float:
        return sum(value * (step.end_s - step.start_s) for value, step in zip(values, steps, strict=True))

    reserved = time_weighted([step.reserved_tokens for step in steps])
    written = time_weighted([step.written_tokens for step in steps])
    return AllocatorResult(
        allocator=allocator,
        capacity_tokens=capacity_tokens,
        num_steps=len(steps),
        makespan_s=makespan,
        throughput_tokens_per_s=output_tokens / makespan,
        mean_in_flight=time_weighted([step.in_flight for step in steps]) / makespan,
        peak_in_flight=max(step.in_flight for step in steps),
        mean_waiting=time_weighted([step.waiting for step in steps]) / makespan,
        waste_share=1 - written / reserved if reserved > 0 else 0.0,
        preemptions=preemptions,
        steps=steps,
    )


def summary_sentence(
    kind: str, budget_mib: int, num_requests: int, contiguous: AllocatorResult, paged: AllocatorResult
) -> str:
    c, p = contiguous, paged
    return (
        f"At {budget_mib} MiB of KV memory, paged blocks hold {in_flight_ratio(c, p):.1f}x "
        f"the requests in flight of contiguous reservations ({p.mean_in_flight:.1f} vs "
        f"{c.mean_in_flight:.1f} on average, {p.peak_in_flight} vs {c.peak_in_flight} at the peak), waste "
        f"{p.waste_share:.0%} vs {c.waste_share:.0%} of the memory they hold, and serve the same "
        f"{num_requests} requests at {throughput_ratio(c, p):.2f}x the "
        f"throughput ({p.throughput_tokens_per_s:,.0f} vs {c.throughput_tokens_per_s:,.0f} output tokens/s, "
        f"{kind})."
    )


def in_flight_ratio(contiguous: AllocatorResult, paged: AllocatorResult) -> float:
    return paged.mean_in_flight / contiguous.mean_in_flight


def throughput_ratio(contiguous: AllocatorResult, paged: AllocatorResult) -> float:
    return paged.throughput_tokens_per_s / contiguous.throughput_tokens_per_s


def compare_memory(
    kind: Literal["simulated", "measured"],
    budget_mib: int,
    reserve: Reserve,
    settings: DemoEngineSettings,
    requests: Sequence[DemoRequest],
    results: dict[Allocator, AllocatorResult],
    cost_model: CostModel | None,
    live_model: str | None = None,
) -> MemoryComparison:
    contiguous, paged = results["contiguous"], results["paged"]
    return MemoryComparison(
        kind=kind,
        budget_mib=budget_mib,
        model=MEMORY_MODEL,
        dtype=MEMORY_DTYPE,
        kv_bytes_per_token=token_bytes(),
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        reserve=reserve,
        cost_model=cost_model,
        live_model=live_model,
        workload=summarize_workload(requests),
        contiguous=contiguous,
        paged=paged,
        in_flight_ratio=in_flight_ratio(contiguous, paged),
        throughput_ratio=throughput_ratio(contiguous, paged),
        summary=summary_sentence(kind, budget_mib, len(requests), contiguous, paged),
    )


def memory_settings() -> DemoEngineSettings:
    """The demo engine's settings with more slots than requests, so memory is the only limit."""
    return DemoEngineSettings(slots=MAX_SLOTS)


def simulate_memory(
    budget_mib: int, reserve: Reserve, cost_model: CostModel, requests: Sequence[DemoRequest] | None = None
) -> MemoryComparison:
    """Both allocators on the same requests (the demo workload by default) and the same budget."""
    workload = list(requests) if requests is not None else demo_workload()
    settings = memory_settings()
    num_blocks = budget_blocks(budget_mib, settings.block_size)
    results = {
        allocator: simulate_allocator(allocator, num_blocks, reserve, workload, settings, cost_model)
        for allocator in ALLOCATORS
    }
    return compare_memory("simulated", budget_mib, reserve, settings, workload, results, cost_model)


@lru_cache(maxsize=256)
def simulate_memory_demo(budget_mib: int, reserve: Reserve, cost_model: CostModel) -> MemoryComparison:
    """`simulate_memory` on the fixed workload, memoised (the page asks for the same budgets again)."""
    return simulate_memory(budget_mib, reserve, cost_model)
