"""Static vs continuous on the same requests: the two results, the ratio, and the sentence that says it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, Field

from inflight.sim.cost_model import CostModel
from inflight.sim.timeline import PolicyResult


class WorkloadSummary(BaseModel):
    num_requests: int
    num_long: int
    prompt_tokens: int
    output_tokens: int


class SizedRequest(Protocol):
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def long(self) -> bool: ...


def summarize_workload(requests: Sequence[SizedRequest]) -> WorkloadSummary:
    return WorkloadSummary(
        num_requests=len(requests),
        num_long=sum(1 for request in requests if request.long),
        prompt_tokens=sum(request.prompt_tokens for request in requests),
        output_tokens=sum(request.output_tokens for request in requests),
    )


class DemoComparison(BaseModel):
    slots: int
    kind: str = Field(description="'simulated' (virtual clock) or 'measured' (the live engine)")
    cost_model: CostModel | None = Field(description="the step cost model; None for measured runs")
    workload: WorkloadSummary
    static: PolicyResult
    continuous: PolicyResult
    throughput_ratio: float = Field(description="continuous throughput / static throughput")
    summary: str


def throughput_ratio(static: PolicyResult, continuous: PolicyResult) -> float:
    if static.throughput_tokens_per_s <= 0:
        return 0.0
    return continuous.throughput_tokens_per_s / static.throughput_tokens_per_s


def summary_sentence(kind: str, static: PolicyResult, continuous: PolicyResult) -> str:
    ratio = throughput_ratio(static, continuous)
    n = len(static.requests)
    return (
        f"At {static.slots} slot{'s' if static.slots != 1 else ''}, continuous batching serves the same "
        f"{n} requests at {ratio:.2f}x the throughput of static batching "
        f"({continuous.throughput_tokens_per_s:,.0f} vs {static.throughput_tokens_per_s:,.0f} "
        f"output tokens/s, {kind})."
    )


def compare(
    kind: str, static: PolicyResult, continuous: PolicyResult, cost_model: CostModel | None
) -> DemoComparison:
    return DemoComparison(
        slots=static.slots,
        kind=kind,
        cost_model=cost_model,
        workload=summarize_workload(static.requests),
        static=static,
        continuous=continuous,
        throughput_ratio=throughput_ratio(static, continuous),
        summary=summary_sentence(kind, static, continuous),
    )
