"""Turns a run's steps into per-request timelines, slot lanes and figures.

The simulator (virtual clock) and the real-engine demo run (wall clock) feed the same recorder, so
simulated and measured results have one shape. Requests all arrive at t=0. A request holds a slot
(a lane in the Gantt chart) from the step that admits it to the step that finishes it; lanes are
handed out lowest-free-first, as a reader would draw them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from inflight.engine.scheduler import StepRecord
from inflight.sim.workload import DemoRequest

Policy = Literal["static", "continuous"]
POLICIES: tuple[Policy, ...] = ("static", "continuous")


class Segment(BaseModel):
    slot: int = Field(description="lane index, 0-based")
    start_s: float
    end_s: float


class RequestTimeline(BaseModel):
    request_id: str
    prompt_tokens: int
    output_tokens: int
    long: bool
    admit_s: float = Field(description="start of the step that first scheduled it")
    first_token_s: float = Field(description="end of the step that produced its first token")
    finish_s: float = Field(description="end of the step that produced its last token")
    latency_s: float = Field(description="finish - arrival (all requests arrive at t=0)")
    preemptions: int
    segments: list[Segment] = Field(description="slot occupancy; more than one only after preemption")


class PolicyResult(BaseModel):
    policy: Policy
    slots: int
    steps: int
    makespan_s: float = Field(description="time until the last request finished")
    output_tokens: int
    throughput_tokens_per_s: float = Field(description="output tokens / makespan")
    mean_latency_s: float
    p95_latency_s: float
    mean_ttft_s: float
    idle_slot_s: float = Field(description="slot-seconds with no request in the slot, up to the makespan")
    idle_slot_fraction: float
    preemptions: int
    requests: list[RequestTimeline]


@dataclass
class _Open:
    slot: int
    start_s: float


@dataclass
class _RequestState:
    admit_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    computed_tokens: int = 0
    segments: list[Segment] = field(default_factory=list)


class TimelineRecorder:
    def __init__(self, policy: Policy, slots: int, requests: Sequence[DemoRequest]) -> None:
        self.policy = policy
        self.slots = slots
        self.requests = list(requests)
        self.steps: list[StepRecord] = []
        self._state = {request.request_id: _RequestState() for request in requests}
        self._prompt_tokens = {request.request_id: request.prompt_tokens for request in requests}
        self._open: dict[str, _Open] = {}
        self._end_s = 0.0

    def record_step(self, start_s: float, end_s: float, step: StepRecord) -> None:
        """One scheduler step that ran from start_s to end_s.

        A request's first token comes at the end of the step that computes the last of its prompt
        tokens (the demo runs without prefix caching, so every prompt token is scheduled; a preempted
        request recomputes from zero, and its first token time stays the first one).
        """
        for request_id in step.preempted:  # preempted while scheduling: the slot is lost at the start
            state = self._state[request_id]
            state.preemptions += 1
            state.computed_tokens = 0
            self._close(request_id, start_s)
        for request_id in step.admitted:
            self._open[request_id] = _Open(slot=self._free_slot(), start_s=start_s)
            state = self._state[request_id]
            if state.admit_s is None:
                state.admit_s = start_s
        for request_id, num_tokens in step.scheduled:
            state = self._state[request_id]
            state.computed_tokens += num_tokens
            if state.first_token_s is None and state.computed_tokens >= self._prompt_tokens[request_id]:
                state.first_token_s = end_s
        for request_id in step.finished:
            self._state[request_id].finish_s = end_s
            self._close(request_id, end_s)
        self.steps.append(step)
        self._end_s = end_s

    def _free_slot(self) -> int:
        taken = {held.slot for held in self._open.values()}
        free = next(slot for slot in range(self.slots + 1) if slot not in taken)
        if free >= self.slots:
            raise RuntimeError(f"the scheduler ran more than {self.slots} requests at once")
        return free

    def _close(self, request_id: str, end_s: float) -> None:
        held = self._open.pop(request_id)
        self._state[request_id].segments.append(Segment(slot=held.slot, start_s=held.start_s, end_s=end_s))

    def result(self) -> PolicyResult:
        unfinished = [rid for rid, state in self._state.items() if state.finish_s is None]
        if unfinished:
            raise RuntimeError(f"run ended with requests unfinished: {', '.join(unfinished)}")
        timelines = []
        for request in self.requests:
            state = self._state[request.request_id]
            assert state.admit_s is not None and state.first_token_s is not None
            assert state.finish_s is not None
            timelines.append(
                RequestTimeline(
                    request_id=request.request_id,
                    prompt_tokens=request.prompt_tokens,
                    output_tokens=request.output_tokens,
                    long=request.long,
                    admit_s=state.admit_s,
                    first_token_s=state.first_token_s,
                    finish_s=state.finish_s,
                    latency_s=state.finish_s,
                    preemptions=state.preemptions,
                    segments=state.segments,
                )
            )
        makespan = self._end_s
        output_tokens = sum(request.output_tokens for request in self.requests)
        latencies = sorted(timeline.latency_s for timeline in timelines)
        busy = sum(seg.end_s - seg.start_s for timeline in timelines for seg in timeline.segments)
        idle = max(0.0, self.slots * makespan - busy)
        return PolicyResult(
            policy=self.policy,
            slots=self.slots,
            steps=len(self.steps),
            makespan_s=makespan,
            output_tokens=output_tokens,
            throughput_tokens_per_s=output_tokens / makespan if makespan > 0 else 0.0,
            mean_latency_s=sum(latencies) / len(latencies),
            p95_latency_s=percentile(latencies, 95),
            mean_ttft_s=sum(timeline.first_token_s for timeline in timelines) / len(timelines),
            idle_slot_s=idle,
            idle_slot_fraction=idle / (self.slots * makespan) if makespan > 0 else 0.0,
            preemptions=sum(timeline.preemptions for timeline in timelines),
            requests=timelines,
        )


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]
