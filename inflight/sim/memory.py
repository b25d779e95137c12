"""Contiguous vs paged KV memory: the demo's 30 requests on one KV memory budget, both ways.

Both runs use the engine's real `ContinuousScheduler` on the virtual clock (the slots panel's
simulator loop and cost model) with more slots than requests, so memory is the only limit; only the
allocator differs:

- contiguous (`ContiguousKVCache`): each request reserves max_model_len tokens (or its prompt +
  max_tokens) up front, as servers before PagedAttention did, and holds them until it finishes;
- paged (the engine's `KVCacheManager`): 16-token blocks taken as the request writes them; out of
  blocks, the scheduler preempts the newest request and recomputes it later.

The budget is bytes of KV memory for a stated model (Llama-3.1-8B in bfloat16 by default: 128 KiB a
token, from `sizing.kv_bytes_per_token`), so the slider reads in MiB.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, Field

from inflight.engine.kv_cache import KVAllocator, KVCacheManager
from inflight.engine.scheduler import Scheduler, StepRecord, create_scheduler
from inflight.sim.comparison import WorkloadSummary, summarize_workload
from inflight.sim.contiguous import ContiguousKVCache
from inflight.sim.cost_model import CostModel
from inflight.sim.simulator import MAX_SLOTS, DemoEngineSettings, run_on_virtual_clock
from inflight.sim.workload import DemoRequest, demo_workload
from inflight.sizing import MIB, find_model, kv_bytes_per_token

Reserve = Literal["max_model_len", "prompt_plus_max_tokens"]
Allocator = Literal["contiguous", "paged"]

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
    budget_mib: int
    model: str = Field(description="the model whose KV bytes per token turn the budget into tokens")
    dtype: str
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    reserve: Reserve = Field(description="what the contiguous allocator reserves per request")
    cost_model: CostModel
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


def reservation_of(requests: Sequence[DemoRequest], reserve: Reserve, max_model_len: int) -> dict[str, int]:
    if reserve == "max_model_len":
        return {request.request_id: max_model_len for request in requests}
    return {request.request_id: request.prompt_tokens + request.output_tokens for request in requests}


def run_allocator(
    allocator: Allocator,
    kv_cache: KVAllocator,
    requests: Sequence[DemoRequest],
    settings: DemoEngineSettings,
    cost_model: CostModel,
) -> AllocatorResult:
    """`requests` through the continuous scheduler over `kv_cache`; what memory held at each step."""
    scheduler = create_scheduler(
        "continuous",
        kv_cache,
        max_num_seqs=settings.slots,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
    )
    steps: list[MemoryStep] = []

    def on_step(start_s: float, end_s: float, _: StepRecord) -> None:
        steps.append(
            MemoryStep(
                start_s=start_s,
                end_s=end_s,
                in_flight=scheduler.num_running,
                waiting=scheduler.num_waiting,
                reserved_tokens=_reserved_tokens(kv_cache),
                written_tokens=sum(seq.num_computed_tokens for seq in scheduler.running),
            )
        )

    run_on_virtual_clock(scheduler, requests, cost_model, on_step)
    return _result(allocator, kv_cache, scheduler, requests, steps)


def _reserved_tokens(kv_cache: KVAllocator) -> int:
    if isinstance(kv_cache, ContiguousKVCache):
        return kv_cache.reserved_tokens
    assert isinstance(kv_cache, KVCacheManager)
    return kv_cache.num_used_blocks * kv_cache.block_size


def _result(
    allocator: Allocator,
    kv_cache: KVAllocator,
    scheduler: Scheduler,
    requests: Sequence[DemoRequest],
    steps: list[MemoryStep],
) -> AllocatorResult:
    makespan = steps[-1].end_s
    output_tokens = sum(request.output_tokens for request in requests)

    def time_weighted(values: Sequence[float]) -> float:
        return sum(value * (step.end_s - step.start_s) for value, step in zip(values, steps, strict=True))

    reserved = time_weighted([step.reserved_tokens for step in steps])
    written = time_weighted([step.written_tokens for step in steps])
    return AllocatorResult(
        allocator=allocator,
        capacity_tokens=kv_cache.num_blocks * kv_cache.block_size,
        num_steps=len(steps),
        makespan_s=makespan,
        throughput_tokens_per_s=output_tokens / makespan,
        mean_in_flight=time_weighted([step.in_flight for step in steps]) / makespan,
        peak_in_flight=max(step.in_flight for step in steps),
        mean_waiting=time_weighted([step.waiting for step in steps]) / makespan,
        waste_share=1 - written / reserved if reserved > 0 else 0.0,
        preemptions=scheduler.num_preemptions_total,
        steps=steps,
    )


def summary_sentence(
    budget_mib: int, num_requests: int, contiguous: AllocatorResult, paged: AllocatorResult
) -> str:
    c, p = contiguous, paged
    return (
        f"At {budget_mib} MiB of KV memory, paged blocks hold {in_flight_ratio(c, p):.1f}x "
        f"the requests in flight of contiguous reservations ({p.mean_in_flight:.1f} vs "
        f"{c.mean_in_flight:.1f} on average, {p.peak_in_flight} vs {c.peak_in_flight} at the peak), waste "
        f"{p.waste_share:.0%} vs {c.waste_share:.0%} of the memory they hold, and serve the same "
        f"{num_requests} requests at {throughput_ratio(c, p):.2f}x the "
        f"throughput ({p.throughput_tokens_per_s:,.0f} vs {c.throughput_tokens_per_s:,.0f} output tokens/s, "
        "simulated)."
    )


def in_flight_ratio(contiguous: AllocatorResult, paged: AllocatorResult) -> float:
    return paged.mean_in_flight / contiguous.mean_in_flight


def throughput_ratio(contiguous: AllocatorResult, paged: AllocatorResult) -> float:
    return paged.throughput_tokens_per_s / contiguous.throughput_tokens_per_s


def simulate_memory(
    budget_mib: int, reserve: Reserve, cost_model: CostModel, requests: Sequence[DemoRequest] | None = None
) -> MemoryComparison:
    """Both allocators on the same requests (the demo workload by default) and the same budget."""
    validate_budget(budget_mib)
    workload = list(requests) if requests is not None else demo_workload()
    settings = DemoEngineSettings(slots=MAX_SLOTS)
    per_token = token_bytes()
    capacity_tokens = budget_mib * MIB // per_token
    reservations = reservation_of(workload, reserve, settings.max_model_len)
    contiguous = run_allocator(
        "contiguous",
        ContiguousKVCache(capacity_tokens, lambda seq_id: reservations[seq_id]),
        workload,
        settings,
        cost_model,
    )
    paged_cache = KVCacheManager(capacity_tokens // settings.block_size, settings.block_size, False)
    paged = run_allocator("paged", paged_cache, workload, settings, cost_model)
    return MemoryComparison(
        budget_mib=budget_mib,
        model=MEMORY_MODEL,
        dtype=MEMORY_DTYPE,
        kv_bytes_per_token=per_token,
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        reserve=reserve,
        cost_model=cost_model,
        workload=summarize_workload(workload),
        contiguous=contiguous,
        paged=paged,
        in_flight_ratio=in_flight_ratio(contiguous, paged),
        throughput_ratio=throughput_ratio(contiguous, paged),
        summary=summary_sentence(budget_mib, len(workload), contiguous, paged),
    )


@lru_cache(maxsize=256)
def simulate_memory_demo(budget_mib: int, reserve: Reserve, cost_model: CostModel) -> MemoryComparison:
    """`simulate_memory` on the fixed workload, memoised (the page asks for the same budgets again)."""
    return simulate_memory(budget_mib, reserve, cost_model)
