"""The demo workload run for real: the loaded model, the engine's real step loop, the wall clock.

Each policy gets its own `LLMEngine` (scheduler + KV cache) with the same settings the simulator uses,
so a real run and a simulated one make the same scheduling decisions; only the step times differ
(measured here, priced by the cost model there). On the server, the demo engines share the live
engine's loaded weights. Steps are timed around `LLMEngine.step()`; the scheduler reports each step's
decisions through its `on_step` hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from inflight.engine.scheduler import StepRecord
from inflight.engine.warmup import warm_up
from inflight.sim.comparison import DemoComparison, compare
from inflight.sim.memory import Allocator
from inflight.sim.simulator import DemoEngineSettings, sampling_params, validate_slots
from inflight.sim.timeline import POLICIES, Policy, TimelineRecorder
from inflight.sim.workload import DemoRequest, demo_workload

if TYPE_CHECKING:
    from inflight.engine.config import ContiguousReserve, EngineConfig, KVAllocatorKind
    from inflight.engine.engine import LLMEngine

PROGRESS_EVERY_S = 5.0


@dataclass
class LiveProgress:
    """How far a real run is: written by the thread running it after every step, read by whoever shows it
    (the demo page polls it). `elapsed_s` and `output_tokens` count the current engine's run only: the
    slots panel's runs one per policy, the memory panel's (`live_memory.py`) one per allocator."""

    requests_total: int = 0
    policy: Policy | None = None
    allocator: Allocator | None = None
    requests_done: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0


@dataclass
class LiveRun:
    recorder: TimelineRecorder
    # (tokens in the step, seconds it took), per step: the calibration's samples.
    step_times: list[tuple[int, float]]


def demo_engine_config(
    policy: Policy,
    settings: DemoEngineSettings,
    base: EngineConfig | None,
    *,
    num_kv_blocks: int | None = None,
    kv_allocator: KVAllocatorKind = "paged",
    contiguous_reserve: ContiguousReserve = "max_model_len",
) -> EngineConfig:
    """The engine settings of a demo run: the simulator's, on the live engine's device and dtype
    (`num_kv_blocks` and the allocator: the memory panel's, else the settings' pool, paged)."""
    from inflight.engine.config import EngineConfig

    return EngineConfig(
        max_num_seqs=settings.slots,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks if num_kv_blocks is not None else settings.num_kv_blocks,
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        max_prefill_tokens_while_decoding=settings.max_prefill_tokens_while_decoding,
        scheduler=policy,
        enable_prefix_caching=False,
        kv_allocator=kv_allocator,
        contiguous_reserve=contiguous_reserve,
        dtype=base.dtype if base is not None else "auto",
        device=base.device if base is not None else "auto",
    )


def run_demo_requests(
    engine: LLMEngine,
    requests: Sequence[DemoRequest],
    on_step: Callable[[float, float, StepRecord], None],
    label: str,
    progress: Callable[[str], None] | None = None,
    tracker: LiveProgress | None = None,
) -> None:
    """All `requests` (arriving together) through `engine` (idle, warmed up), stepped to the end.

    After every step, `on_step(start_s, end_s, record)` (seconds from the first step's start; steps
    numbered from it too) hears what it decided, with the engine showing the state the step left.
    `progress` (if given) hears about the run every few seconds, as `label`; `tracker` (if given) is
    brought up to date after every step.
    """
    records: list[StepRecord] = []
    first_step = engine.scheduler.num_steps
    # Number the steps from this run's start (the warm-up took some), as the simulator does.
    engine.scheduler.on_step = lambda record: records.append(replace(record, step=record.step - first_step))
    for request in requests:
        engine.add_request(request.request_id, list(request.prompt_token_ids), sampling_params(request))
    generated_before = engine.stats().num_generation_tokens  # the warm-up's
    begin = last_report = time.perf_counter()
    finished = num_steps = 0
    if tracker is not None:
        tracker.requests_done, tracker.output_tokens, tracker.elapsed_s = 0, 0, 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        failed = [output for output in outputs if output.error]
        if failed:
            raise RuntimeError(f"the engine failed demo request {failed[0].request_id}: {failed[0].error}")
        for record in records:
            on_step(start - begin, end - begin, record)
            finished += len(record.finished)
            num_steps += 1
        records.clear()
        if tracker is not None:
            tracker.requests_done = finished
            tracker.output_tokens = engine.stats().num_generation_tokens - generated_before
            tracker.elapsed_s = end - begin
        if progress is not None and end - last_report >= PROGRESS_EVERY_S:
            last_report = end
            progress(f"  {label}: {num_steps} steps, {finished}/{len(requests)} requests done")


def run_live_policy(
    model_dir: Path,
    policy: Policy,
    requests: Sequence[DemoRequest],
    settings: DemoEngineSettings,
    base_config: EngineConfig | None = None,
    progress: Callable[[str], None] | None = None,
    share_model_of: LLMEngine | None = None,
    tracker: LiveProgress | None = None,
) -> LiveRun:
    """All `requests` (arriving together) through a fresh engine with `policy`, stepped to the end.

    `progress`, `tracker`: as for `run_demo_requests`. `share_model_of`: an engine whose loaded weights
    to use (the server's live engine) instead of loading them again.
    """
    from inflight.engine.engine import LLMEngine

    config = demo_engine_config(policy, settings, base_config)
    engine = LLMEngine(model_dir, config, share_model_of=share_model_of)
    warm_up(engine)
    recorder = TimelineRecorder(policy, settings.slots, requests)
    step_times: list[tuple[int, float]] = []

    def on_step(start_s: float, end_s: float, record: StepRecord) -> None:
        recorder.record_step(start_s, end_s, record)
        step_times.append((sum(tokens for _, tokens in record.scheduled), end_s - start_s))

    if tracker is not None:
        tracker.policy = policy
    run_demo_requests(engine, requests, on_step, policy, progress, tracker)
    return LiveRun(recorder, step_times)


def run_live(
    model_dir: Path,
    slots: int,
    base_config: EngineConfig | None = None,
    requests: Sequence[DemoRequest] | None = None,
    progress: Callable[[str], None] | None = None,
    share_model_of: LLMEngine | None = None,
    tracker: LiveProgress | None = None,
) -> tuple[DemoComparison, list[tuple[int, float]]]:
    """Both policies for real at `slots` slots; the comparison and every step's (tokens, seconds)."""
    validate_slots(slots)
    workload = list(requests) if requests is not None else demo_workload()
    settings = DemoEngineSettings(slots=slots)
    if tracker is not None:
        tracker.requests_total = len(workload)
    runs: dict[Policy, LiveRun] = {}
    for policy in POLICIES:
        if progress is not None:
            progress(f"running {len(workload)} requests with {policy} batching at {slots} slots")
        runs[policy] = run_live_policy(
            model_dir, policy, workload, settings, base_config, progress, share_model_of, tracker
        )
    comparison = compare(
        "measured", runs["static"].recorder.result(), runs["continuous"].recorder.result(), cost_model=None
    )
    return comparison, [sample for run in runs.values() for sample in run.step_times]


def run_live_demo(live_engine: LLMEngine, slots: int, tracker: LiveProgress | None = None) -> DemoComparison:
    """What `POST /v1/demo/run` answers: both policies on the live engine's model and device."""
    comparison, _ = run_live(
        live_engine.model_dir, slots, live_engine.config, share_model_of=live_engine, tracker=tracker
    )
    return comparison
