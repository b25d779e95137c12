"""The engine's real schedulers and KV-cache manager, run on a virtual clock instead of a model.

Nothing about scheduling is re-implemented here: the simulator builds the same `ContinuousScheduler` /
`StaticScheduler` over the same `KVCacheManager` that `LLMEngine` uses, with the settings the demo's
real run uses, and drives it exactly as the engine does (`schedule()` then `update()`). The only
difference is the model: instead of running it, each sampled token is the next of the request's
predetermined output, and the step advances the clock by the cost model's price for the tokens it
carried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from inflight.engine.config import CPU_PREFILL_TOKENS_WHILE_DECODING
from inflight.engine.kv_cache import KVCacheManager
from inflight.engine.scheduler import Scheduler, StepRecord, create_scheduler
from inflight.engine.sequence import SamplingParams
from inflight.engine.sequence import Sequence as EngineSequence
from inflight.sim.comparison import DemoComparison, compare
from inflight.sim.cost_model import CostModel
from inflight.sim.timeline import Policy, PolicyResult, TimelineRecorder
from inflight.sim.workload import DemoRequest, demo_workload

MIN_SLOTS = 1
MAX_SLOTS = 32


@dataclass(frozen=True)
class DemoEngineSettings:
    """Engine settings shared by the simulation and the demo's real run, so both schedule alike.

    The KV pool holds every slot's longest possible sequence, so the demo shows batching, not
    preemption; prefix caching is off (the prompts share nothing, and every prompt token is computed).
    """

    slots: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512
    # The engine's CPU default for models no larger than SmolLM2-135M, given to the demo's real engine on
    # any device and for any model, so the simulation and the real run schedule the same steps.
    max_prefill_tokens_while_decoding: int = CPU_PREFILL_TOKENS_WHILE_DECODING

    @property
    def num_kv_blocks(self) -> int:
        return self.slots * -(-self.max_model_len // self.block_size)


def validate_slots(slots: int) -> None:
    if not MIN_SLOTS <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be between {MIN_SLOTS} and {MAX_SLOTS}, got {slots}")


def build_scheduler(policy: Policy, settings: DemoEngineSettings) -> Scheduler:
    kv_cache = KVCacheManager(settings.num_kv_blocks, settings.block_size, enable_prefix_caching=False)
    return create_scheduler(
        policy,
        kv_cache,
        max_num_seqs=settings.slots,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        max_prefill_tokens_while_decoding=settings.max_prefill_tokens_while_decoding,
    )


def sampling_params(request: DemoRequest) -> SamplingParams:
    """What the demo asks the real engine for: exactly the request's output length, greedy."""
    return SamplingParams(max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True)


def simulate_policy(
    policy: Policy,
    requests: Sequence[DemoRequest],
    settings: DemoEngineSettings,
    cost_model: CostModel,
) -> TimelineRecorder:
    """Run `requests` (all arriving at t=0) through the real scheduler on the virtual clock."""
    recorder = TimelineRecorder(policy, settings.slots, requests)
    run_on_virtual_clock(build_scheduler(policy, settings), requests, cost_model, recorder.record_step)
    return recorder


def run_on_virtual_clock(
    scheduler: Scheduler,
    requests: Sequence[DemoRequest],
    cost_model: CostModel,
    on_step: Callable[[float, float, StepRecord], None],
) -> None:
    """Drive `scheduler` as `LLMEngine` does until every request (all arriving at t=0) is done.

    After each step's `update`, `on_step(start_s, end_s, record)` hears what it decided; the scheduler
    and its KV allocator already show the state the step left.
    """
    clock = 0.0

    def record(step: StepRecord) -> None:
        nonlocal clock
        start = clock
        clock += cost_model.step_seconds(sum(tokens for _, tokens in step.scheduled))
        on_step(start, clock, step)

    scheduler.on_step = record
    outputs = {request.request_id: request.output_token_ids for request in requests}

    def next_token(seq: EngineSequence) -> int:
        return outputs[seq.request_id][seq.num_output_tokens]

    for request in requests:
        scheduler.add(
            EngineSequence(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                params=sampling_params(request),
            )
        )
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        if out.failed:
            reasons = "; ".join(f"{seq.seq_id}: {seq.error}" for seq in out.failed)
            raise RuntimeError(f"the demo settings cannot run the workload: {reasons}")
        if out.is_empty:
            raise RuntimeError(f"{scheduler.policy} scheduler made no progress with requests unfinished")
        sampled = {item.seq.seq_id: [next_token(item.seq)] for item in out.sampling}
        scheduler.update(out, sampled)


def simulate(
    slots: int, cost_model: CostModel, requests: Sequence[DemoRequest] | None = None
) -> DemoComparison:
    """Both policies on the same requests (the fixed demo workload by default) at `slots` slots."""
    validate_slots(slots)
    workload = list(requests) if requests is not None else demo_workload()
    settings = DemoEngineSettings(slots=slots)
    results: dict[Policy, PolicyResult] = {
        policy: simulate_policy(policy, workload, settings, cost_model).result()
        for policy in ("static", "continuous")
    }
    return compare("simulated", results["static"], results["continuous"], cost_model)


@lru_cache(maxsize=256)
def simulate_demo(slots: int, cost_model: CostModel) -> DemoComparison:
    """`simulate` on the fixed workload, memoised (the page asks for the same slot counts again)."""
    return simulate(slots, cost_model)
