"""The async engine loop with a scripted engine: ordering, back-pressure, abort, failure isolation, drain."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from inflight.engine.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    Generation,
    GenerationRequest,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
)
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.output_processor import CompletionOutput, RequestOutput
from inflight.engine.sampler import SampleResult, SamplingRow
from inflight.engine.sequence import Logprob, SamplingParams
from inflight.engine.stats import EngineStats

POISON_PROMPT = [666]  # the scripted engine's step() raises while this prompt is in it
REJECTED_PROMPT = [13]  # its add_request() raises ValueError


class ScriptedTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [5, 6]


@dataclass
class ScriptedEngine:
    """Each step appends token 7 to every request (its output: that token, a delta); a request finishes
    at its max_tokens."""

    tokenizer: ScriptedTokenizer = field(default_factory=ScriptedTokenizer)
    # What the async engine logs once the engine is ready.
    model_dir: str = "scripted"
    device: str = "cpu"
    dtype: str = "float32"
    config: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_seqs=2))
    num_kv_blocks: int = 16
    max_model_len: int = 64
    requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = field(default_factory=dict)
    gate: threading.Event = field(default_factory=threading.Event)
    steps: int = 0
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gate.set()

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if prompt == REJECTED_PROMPT:
            raise ValueError("token 13 is outside the vocabulary")
        self.requests[request_id] = (prompt, params, [])

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def set_failure_callback(self, callback: object) -> None:
        pass

    def close(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        self.gate.wait(60)  # a hang guard; tests that clear the gate set it again
        self.steps += 1
        if any(prompt == POISON_PROMPT for prompt, _, _ in self.requests.values()):
            raise RuntimeError("scripted step failure")
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.requests.items()):
            tokens.append(7)
            finished = len(tokens) >= (params.max_tokens or 1)
            if finished:
                del self.requests[request_id]
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=prompt,
                    outputs=[
                        CompletionOutput(
                            0, "x", [7], "length" if finished else None, logprobs=[{7: Logprob(-0.5, 1)}]
                        )
                    ],
                    finished=finished,
                )
            )
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.requests),
            num_waiting=0,
            num_used_blocks=len(self.requests),
            num_blocks=16,
            kv_cache_usage=len(self.requests) / 16,
            num_preemptions=0,
            num_prefix_cache_queries=0,
            num_prefix_cache_hits=0,
            num_prompt_tokens=10 * self.steps,
            num_generation_tokens=self.steps,
            num_steps=self.steps,
            last_step_num_batched_tokens=0,
            max_num_seqs=2,
        )


def request(
    request_id: str, max_tokens: int = 3, prompt: list[int] | None = None, n: int = 1
) -> GenerationRequest:
    return GenerationRequest(request_id, prompt or [1, 2], SamplingParams(max_tokens=max_tokens, n=n))


@pytest.fixture
async def scripted() -> object:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(lambda: engine, max_slots=2, max_queue=1)  # type: ignore[arg-type,return-value]
    async_engine.start()
    await async_engine.wait_ready()
    yield engine, async_engine
    engine.gate.set()
    await async_engine.drain(timeout=0)
    await async_engine.stop()


async def eventually(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll `check` on the event loop until it is true; fail naming `what` after `timeout` s (hang guard)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)


async def collect(generation: object) -> list[RequestOutput]:
    return [output async for _, output in generation.outputs()]  # type: ignore[attr-defined]


async def test_outputs_arrive_in_order_and_warm_up_is_not_counted(scripted: tuple) -> None:
    engine, async_engine = scripted
    assert async_engine.state == "ready"
    assert engine.steps == 2  # the warm-up request ran two steps before ready
    outputs = await collect(async_engine.submit([request("a", max_tokens=3)]))
    # Deltas: one per step, or several steps merged if this consumer fell behind.
    assert [t for o in outputs for t in o.outputs[0].token_ids] == [7, 7, 7]
    assert "".join(o.outputs[0].text for o in outputs) == "xxx"
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert async_engine.stats().num_generation_tokens == 3  # warm-up steps subtracted
    assert async_engine.num_in_flight == 0


async def test_unread_deltas_merge_into_one_pending_output_per_request(scripted: tuple) -> None:
    _, async_engine = scripted
    generation = async_engine.submit([request("p0", max_tokens=50), request("p1", max_tokens=30)])
    # Not reading: the engine runs every step, the generation keeps one merged delta per request.
    await eventually(lambda: not generation.unfinished - finished_ids(generation), "both requests to finish")
    assert len(generation.pending) == 2
    outputs = await collect(generation)
    assert [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in outputs] == [
        ("p0", 50, True),
        ("p1", 30, True),
    ]
    (p0, _) = outputs
    assert p0.outputs[0].text == "x" * 50 and p0.outputs[0].logprobs == [{7: Logprob(-0.5, 1)}] * 50


async def test_a_busy_event_loop_gets_one_merged_delivery_not_a_callback_per_step(scripted: tuple) -> None:
    """The engine thread posts one delivery until the loop runs it; later steps' deltas merge into it. A
    callback per step let a fast engine queue them faster than a busy loop ran them: a drain's timeout
    then never came (test_drain_cuts_what_is_left_at_the_timeout hung in the whole suite)."""
    engine, async_engine = scripted
    loop = asyncio.get_running_loop()
    posted: list[object] = []
    post = loop.call_soon_threadsafe

    def counted(callback: Callable[..., object], *args: object, context: object = None) -> asyncio.Handle:
        posted.append(callback)
        return post(callback, *args, context=context)  # type: ignore[arg-type]

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        generation = async_engine.submit([request("p0", max_tokens=50), request("p1", max_tokens=30)])
        deadline = time.monotonic() + 60
        while engine.requests or engine.steps < 52:  # the loop blocked here: the engine runs every step
            assert time.monotonic() < deadline, "timed out waiting for the engine to finish both requests"
            time.sleep(0.001)
    finally:
        del loop.call_soon_threadsafe
    assert len(posted) == 1
    outputs = await collect(generation)
    assert [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in outputs] == [
        ("p0", 50, True),
        ("p1", 30, True),
    ]


def finished_ids(generation: Generation) -> set[str]:
    return {rid for rid, output in generation.pending.items() if output.finished}


async def test_requests_of_one_submission_share_a_generation(scripted: tuple) -> None:
    _, async_engine = scripted
    generation = async_engine.submit([request("p0", max_tokens=1), request("p1", max_tokens=2)])
    seen = [(index, o.request_id, len(o.outputs[0].token_ids)) async for index, o in generation.outputs()]
    assert {(index, rid) for index, rid, _ in seen} == {(0, "p0"), (1, "p1")}
    assert sum(n for _, rid, n in seen if rid == "p1") == 2


async def test_capacity_is_slots_plus_queue_and_frees_on_finish(scripted: tuple) -> None:
    engine, async_engine = scripted
    engine.gate.clear()  # hold the engine so nothing finishes
    first = async_engine.submit([request("a", n=2)])
    second = async_engine.submit([request("b")])
    with pytest.raises(QueueFullError) as raised:
        async_engine.submit([request("c")])
    assert raised.value.retry_after >= 1
    engine.gate.set()
    await collect(first)
    await collect(second)
    await collect(async_engine.submit([request("c")]))


async def test_close_aborts_in_the_engine_and_frees_capacity(scripted: tuple) -> None:
    engine, async_engine = scripted
    generation = async_engine.submit([request("long", max_tokens=10_000)])
    async for _ in generation.outputs():
        break
    generation.close()
    assert async_engine.num_in_flight == 0
    await eventually(lambda: "long" in engine.aborted, "the engine thread to apply the abort")
    assert engine.aborted == ["long"]
    assert not engine.requests


async def test_a_rejected_request_fails_alone(scripted: tuple) -> None:
    _, async_engine = scripted
    good = async_engine.submit([request("good", max_tokens=2)])
    bad = async_engine.submit([request("bad", prompt=REJECTED_PROMPT)])
    with pytest.raises(RequestFailedError, match="outside the vocabulary"):
        await collect(bad)
    assert (await collect(good))[-1].finished


async def test_the_loop_survives_a_failing_step(scripted: tuple) -> None:
    engine, async_engine = scripted
    with pytest.raises(RequestFailedError, match="scripted step failure"):
        await collect(async_engine.submit([request("poison", prompt=POISON_PROMPT)]))
    assert "poison" in engine.aborted
    assert (await collect(async_engine.submit([request("after", max_tokens=2)])))[-1].finished


async def test_drain_refuses_new_requests_and_waits_for_in_flight_ones(scripted: tuple) -> None:
    engine, async_engine = scripted
    engine.gate.clear()  # the request cannot finish until the gate opens
    short = async_engine.submit([request("short", max_tokens=2)])
    short_outputs = asyncio.ensure_future(collect(short))
    drain = asyncio.ensure_future(async_engine.drain(timeout=60))
    await asyncio.sleep(0)  # the drain starts: no admissions from now on
    with pytest.raises(EngineUnavailableError, match="shutting down"):
        async_engine.submit([request("late")])
    assert async_engine.state == "draining"
    assert not drain.done()
    engine.gate.set()
    assert await drain == 0
    assert (await short_outputs)[-1].finished


async def test_drain_cuts_what_is_left_at_the_timeout(scripted: tuple) -> None:
    _, async_engine = scripted
    short = async_engine.submit([request("short", max_tokens=2)])
    endless = async_engine.submit([request("endless", max_tokens=10_000_000)])
    assert (await collect(short))[-1].finished
    assert await async_engine.drain(timeout=0.1) == 1  # `endless` can never finish in time
    with pytest.raises(RequestAbortedError):
        await collect(endless)
    assert async_engine.state == "draining"


async def test_the_startup_heap_is_frozen_while_serving_and_thawed_when_the_engine_stops() -> None:
    engine = ScriptedEngine()
    startup_object = [engine]  # alive before the engine starts, like the model and the app
    async_engine = AsyncEngine(lambda: engine, max_slots=2, max_queue=1)  # type: ignore[arg-type,return-value]
    async_engine.start()
    await async_engine.wait_ready()
    # Full collections skip frozen objects; gc.get_objects() lists only the collected generations.
    assert gc.get_freeze_count() > 0
    assert not any(o is startup_object for o in gc.get_objects())
    assert (await collect(async_engine.submit([request("a")])))[-1].finished
    await async_engine.drain(timeout=0)
    await async_engine.stop()
    await eventually(lambda: gc.get_freeze_count() == 0, "the engine thread to thaw the heap")
    assert any(o is startup_object for o in gc.get_objects())


async def test_a_failed_load_is_reported() -> None:
    def broken() -> object:
        raise FileNotFoundError("no model.safetensors")

    failures: list[BaseException] = []
    async_engine = AsyncEngine(broken, max_slots=1, max_queue=0, on_fatal=failures.append)  # type: ignore[arg-type]
    async_engine.start()
    with pytest.raises(EngineUnavailableError, match=r"no model\.safetensors"):
        await async_engine.wait_ready()
    assert async_engine.state == "failed"
    assert isinstance(failures[0], FileNotFoundError)
    with pytest.raises(EngineUnavailableError):
        async_engine.submit([request("x")])
    await async_engine.stop()


def delta_tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.outputs[0].token_ids]


async def test_a_request_whose_sampling_fails_fails_alone_in_the_async_engine(tiny_llama_dir: Path) -> None:
    """A real engine whose sampler raises for one request's rows: that request ends with "error" and a
    reason, the request batched with it gets exactly its tokens, and the loop keeps serving."""
    engine = LLMEngine(
        tiny_llama_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=64, block_size=8, device="cpu")
    )
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("def main(")
    (expected,) = engine.generate([prompt], greedy)
    sampler = engine.runner.sampler

    def poisoned(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        if any(r.params.seed == 666 and r.output_position >= 2 for r in rows):
            raise RuntimeError("poisoned sampling parameters")
        return sampler(logits, rows)

    engine.runner.sampler = poisoned  # type: ignore[assignment]
    async_engine = AsyncEngine(lambda: engine, max_slots=4, max_queue=4)
    async_engine.start()
    await async_engine.wait_ready()
    try:
        good = async_engine.submit([GenerationRequest("good", prompt, greedy)])
        bad = async_engine.submit([GenerationRequest("bad", prompt, replace(greedy, seed=666))])
        good_outputs, bad_outputs = await asyncio.gather(collect(good), collect(bad))
        assert delta_tokens(good_outputs) == expected.outputs[0].token_ids
        failed = bad_outputs[-1]
        assert failed.finished and failed.outputs[0].finish_reason == "error"
        assert failed.error is not None and "poisoned sampling parameters" in failed.error
        after = await collect(async_engine.submit([GenerationRequest("after", prompt, greedy)]))
        assert delta_tokens(after) == expected.outputs[0].token_ids
        assert async_engine.stats().num_used_blocks == 0
    finally:
        await async_engine.drain(timeout=0)
        await async_engine.stop()
