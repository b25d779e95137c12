"""The server's engine loop: the blocking engine runs in its own thread; asyncio never waits on it.

- One thread owns the `LLMEngine`: it loads it, runs a warm-up request, then loops: apply queued
  adds/aborts -> `step()` -> hand the step's outputs to the event loop. They wait in an outbox, each
  request's deltas merged into one, with one delivery (`call_soon_threadsafe`) posted at a time: while
  the event loop is busy, a fast engine's steps cost it at most one output per request, not a callback
  per step (a backlog that could outgrow what the loop runs, so that a drain's timeout never came).
  Nothing else touches the engine, so it needs no locks.
- `submit()` registers one HTTP request's engine requests and returns a `Generation`. Outputs are
  deltas (the engine runs every request with `output_kind="delta"`): each holds only the tokens, text
  and logprobs that are new since the previous one. What the consumer has not read yet is merged into
  one pending delta per request, so a client that stops reading costs memory in proportion to its
  output, never one copy per step. Closing a generation early (client gone) aborts its requests: the
  engine frees their KV blocks before its next step.
- The heap the engine starts with is frozen out of garbage collection once it is warm
  (`freeze_startup_heap`): full collections then skip the model and the app.
- Back-pressure: at most `max_slots + max_queue` sequences may be in flight; beyond that `submit()`
  raises `QueueFullError` with a Retry-After estimate (the server answers 429).
- Isolation: a request the engine rejects fails alone; so does one whose sampling or output processing
  raises inside a step (the engine ends it with finish_reason "error" and the reason in `error`; the
  rest of the batch carries on). Should `step()` itself raise (the model's forward pass), the requests in
  the engine fail with `RequestFailedError`, are aborted, and the loop carries on with new ones.
- `drain()` stops admissions (`EngineUnavailableError`), waits for in-flight requests up to a grace
  period (or until told to stop waiting), then aborts the rest (`RequestAbortedError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from inflight.engine.errors import EngineDeadError
from inflight.engine.stats import EngineStats
from inflight.engine.warmup import warm_up

if TYPE_CHECKING:
    from inflight.engine.engine import LLMEngine
    from inflight.engine.output_processor import RequestOutput
    from inflight.engine.scheduler import CapacityError
    from inflight.engine.sequence import GuidedDecoding, SamplingParams
    from inflight.engine.tokenizer import Tokenizer

logger = logging.getLogger("inflight.engine")

State = Literal["loading", "ready", "draining", "stopped", "failed"]


class QueueFullError(Exception):
    """Too many requests in flight; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailableError(Exception):
    """The engine is loading, draining for shutdown, stopped, or failed to load."""


class RequestFailedError(Exception):
    """The engine failed while running this request (a server-side fault)."""


class RequestAbortedError(Exception):
    """The request was cut short because the server is shutting down."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Add:
    request: GenerationRequest


@dataclass
class _Abort:
    request_id: str


def keep_unread(unread: dict[str, RequestOutput], output: RequestOutput) -> None:
    """Keep a delta output until its consumer reads it: merged into its request's unread one in `unread`
    if there is one, else added after the requests already waiting."""
    waiting = unread.get(output.request_id)
    if waiting is None:
        unread[output.request_id] = output
    else:
        waiting.merge(output)


@dataclass(eq=False)
class Generation:
    """The delta outputs of one HTTP request's engine requests (one per prompt), in the order they come;
    at most one pending (unread, merged) delta per request."""

    engine: AsyncEngine
    request_ids: list[str]
    num_seqs: int
    arrival_time: float = field(default_factory=time.monotonic)
    unfinished: set[str] = field(default_factory=set)
    # request id -> the deltas not read yet, merged, oldest first.
    pending: dict[str, RequestOutput] = field(default_factory=dict)
    failure: BaseException | None = None
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # request id -> its prompt's index in the HTTP request.
    _prompt_index: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)
        self._prompt_index = {request_id: index for index, request_id in enumerate(self.request_ids)}

    def put(self, output: RequestOutput) -> None:
        """Queue a delta output, merged into the request's unread one if there is one."""
        keep_unread(self.pending, output)
        self._arrived.set()

    def fail(self, error: BaseException) -> None:
        """Make `outputs()` raise `error` once the pending outputs are read (the first failure wins)."""
        if self.failure is None:
            self.failure = error
        self._arrived.set()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, delta output) until every request finished; raise what failed a request."""
        while True:
            if self.pending:
                request_id = next(iter(self.pending))
                output = self.pending.pop(request_id)
                if output.finished:
                    self.unfinished.discard(request_id)
                yield self._prompt_index[request_id], output
            elif self.failure is not None:
                raise self.failure
            elif not self.unfinished:
                return
            else:
                self._arrived.clear()
                await self._arrived.wait()

    def close(self) -> None:
        """Abort whatever has not finished (idempotent); the engine frees those KV blocks."""
        if self.unfinished:
            self.engine.abort(self)


def freeze_startup_heap() -> None:
    """Move every object alive now (model, tokenizer, the server's app: about 345,000 in a `small` server)
    out of the garbage collector's reach. A full collection walks them all, holding the GIL for 150-280 ms
    on the CPU machine of docs/benchmarks.md, and the engine thread needs the GIL between every two torch
    ops: each one was a stall in every stream. Frozen objects are still freed when their last reference
    goes; only cycles among them wait for `gc.unfreeze()`, which the engine thread calls when it stops."""
    gc.collect()
    gc.freeze()


class AsyncEngine:
    """Runs an `LLMEngine` (built by `load`) in a background thread for an asyncio server."""

    def __init__(
        self,
        load: Callable[[], LLMEngine],
        *,
        max_slots: int,
        max_queue: int,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._load = load
        self.max_slots = max_slots
        self.max_queue = max_queue
        self.on_fatal = on_fatal
        self.state: State = "loading"
        self.error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        # Engine-thread inbox.
        self._wakeup = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        # Set (from another thread) when a part of the engine outside this process died.
        self._dead: BaseException | None = None
        # Engine-thread results the event loop has not taken yet (see _hand_over).
        self._outbox_lock = threading.Lock()
        self._outbox: dict[str, RequestOutput] = {}
        self._outbox_failures: list[tuple[str, BaseException]] = []
        # Event-loop side bookkeeping.
        self._generations: dict[str, Generation] = {}
        self._seqs_in_flight = 0
        self._recent_finishes: deque[float] = deque(maxlen=32)
        # Written by the engine thread, read anywhere (one attribute assignment is atomic).
        self._stats = EngineStats(max_num_seqs=max_slots)
        self.started_at = int(time.time())
        self._baseline = EngineStats()

    # ------------------------------------------------------------------ lifecycle (event loop)

    def start(self) -> None:
        """Start the engine thread: load, warm up, then serve. Call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="inflight-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Return once the engine is loaded and warmed up; raise if loading failed."""
        await self._ready.wait()
        if self.state == "failed":
            raise EngineUnavailableError(f"the engine failed to start: {self.error}")

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineUnavailableError("the model is still loading")
        return self._engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def compile_grammar(self, guided: GuidedDecoding) -> None:
        """Compile (or find in the cache) a request's grammar; raises GrammarError. Thread-safe: the
        server calls it off the event loop, before submitting the request."""
        self.engine.grammars.compile(guided)

    def capacity_error(self, num_prompt_tokens: int, max_tokens: int | None) -> CapacityError | None:
        """Why a request of this size could never run here (the engine's sizes never change after load)."""
        return self.engine.scheduler.capacity_error(num_prompt_tokens, max_tokens)

    @property
    def num_in_flight(self) -> int:
        return len(self._generations)

    async def drain(self, timeout: float, stop_waiting: asyncio.Event | None = None) -> int:
        """Refuse new requests, wait up to `timeout` s (or until `stop_waiting` is set) for in-flight ones,
        abort the rest; return how many."""
        if self.state in ("loading", "ready"):
            self.state = "draining"
        waits = [self._idle.wait(), *([stop_waiting.wait()] if stop_waiting is not None else [])]
        tasks = [asyncio.ensure_future(wait) for wait in waits]
        try:
            await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
        leftover = set(self._generations.values())
        for generation in leftover:
            generation.fail(RequestAbortedError("the server is shutting down"))
            generation.close()
        return len(leftover)

    async def stop(self) -> None:
        """Stop the engine thread (after `drain`, or at once)."""
        if self.state != "failed":
            self.state = "stopped"
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------ requests (event loop)

    def submit(self, requests: list[GenerationRequest]) -> Generation:
        """Queue these engine requests together (all or none); raise if not accepting or full."""
        if self.state != "ready":
            raise EngineUnavailableError(
                {
                    "loading": "the model is still loading; retry shortly",
                    "draining": "the server is shutting down",
                    "stopped": "the server is shutting down",
                    "failed": f"the engine failed: {self.error}",
                }[self.state]
            )
        num_seqs = sum(request.params.n for request in requests)
        capacity = self.max_slots + self.max_queue
        if self._seqs_in_flight + num_seqs > capacity:
            raise QueueFullError(
                f"the server is at capacity ({self._seqs_in_flight} sequences in flight, "
                f"{self.max_slots} slots + {self.max_queue} queued allowed); retry later",
                self._retry_after(self._seqs_in_flight + num_seqs - capacity),
            )
        generation = Generation(self, [r.request_id for r in requests], num_seqs)
        for request in requests:
            self._generations[request.request_id] = generation
        self._seqs_in_flight += num_seqs
        self._idle.clear()
        self._send([_Add(request) for request in requests])
        return generation

    def abort(self, generation: Generation) -> None:
        request_ids = [rid for rid in generation.request_ids if rid in generation.unfinished]
        generation.unfinished.clear()
        for request_id in request_ids:
            self._forget(request_id)
        self._send([_Abort(request_id) for request_id in request_ids])

    def stats(self) -> EngineStats:
        """The latest engine state; counters exclude the warm-up request."""
        now, base = self._stats, self._baseline
        return replace(
            now,
            num_preemptions=now.num_preemptions - base.num_preemptions,
            num_prefix_cache_queries=now.num_prefix_cache_queries - base.num_prefix_cache_queries,
            num_prefix_cache_hits=now.num_prefix_cache_hits - base.num_prefix_cache_hits,
            num_prompt_tokens=now.num_prompt_tokens - base.num_prompt_tokens,
            num_generation_tokens=now.num_generation_tokens - base.num_generation_tokens,
            num_steps=now.num_steps - base.num_steps,
            num_draft_tokens=now.num_draft_tokens - base.num_draft_tokens,
            num_accepted_tokens=now.num_accepted_tokens - base.num_accepted_tokens,
        )

    def _retry_after(self, excess: int) -> int:
        """Seconds until about `excess` requests have finished, at the recent finishing rate (1..60)."""
        finishes = self._recent_finishes
        if len(finishes) < 2 or finishes[-1] <= finishes[0]:
            return 1
        rate = (len(finishes) - 1) / (finishes[-1] - finishes[0])
        return max(1, min(60, math.ceil(excess / rate)))

    def _forget(self, request_id: str) -> None:
        generation = self._generations.pop(request_id, None)
        if generation is None:
            return
        if not any(rid in self._generations for rid in generation.request_ids):
            self._seqs_in_flight -= generation.num_seqs
            self._recent_finishes.append(time.monotonic())
        if not self._generations:
            self._idle.set()

    def _send(self, commands: list[_Add | _Abort]) -> None:
        with self._wakeup:
            self._commands.extend(commands)
            self._wakeup.notify()

    def _deliver(self) -> None:
        """Runs on the event loop: route the engine thread's results to their generations."""
        with self._outbox_lock:
            outputs, self._outbox = list(self._outbox.values()), {}
            failures, self._outbox_failures = self._outbox_failures, []
        for output in outputs:
            generation = self._generations.get(output.request_id)
            if generation is None:
                continue  # aborted meanwhile
            generation.put(output)
            if output.finished:
                self._forget(output.request_id)
        for request_id, error in failures:
            failed = self._generations.get(request_id)
            if failed is not None:
                failed.fail(error)
                self._forget(request_id)

    def _set_ready(self) -> None:
        self.started_at = int(time.time())
        if self.state == "loading":
            self.state = "ready"
        self._ready.set()

    def _set_failed(self, error: BaseException) -> None:
        self.state = "failed"
        self.error = error
        self._ready.set()
        for generation in list(self._generations.values()):
            generation.fail(RequestFailedError(f"the engine stopped: {error}"))
        self._generations.clear()
        self._idle.set()
        if self.on_fatal is not None:
            self.on_fatal(error)

    # ------------------------------------------------------------------ engine thread

    def _hand_over(self, outputs: list[RequestOutput], failures: list[tuple[str, BaseException]]) -> None:
        """Engine thread: put a step's results in the outbox, each output merged into its request's one
        there, and post a delivery unless one is posted and not yet run (the outbox is not empty)."""
        with self._outbox_lock:
            posted = bool(self._outbox or self._outbox_failures)
            for output in outputs:
                keep_unread(self._outbox, output)
            self._outbox_failures.extend(failures)
        if not posted:
            self._post(self._deliver)

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed under us (process exit)
            self._loop.call_soon_threadsafe(callback, *args)

    def _thread_main(self) -> None:
        try:
            engine = self._load()
            self._engine = engine
            engine.set_failure_callback(self._engine_died)
            self._warm_up(engine)
        except Exception as error:
            # The message says what is wrong (missing weights, bad config...); traceback at debug level.
            logger.error(
                "the engine failed to load or warm up: %s", error, exc_info=logger.isEnabledFor(logging.DEBUG)
            )
            if self._engine is not None:
                self._engine.close()
            self._post(self._set_failed, error)
            return
        logger.info(
            "engine ready: %s on %s (%s), %d slots, %d KV blocks of %d tokens, max_model_len %d, %s",
            engine.model_dir,
            engine.device,
            str(engine.dtype).removeprefix("torch."),
            engine.config.max_num_seqs,
            engine.num_kv_blocks,
            engine.config.block_size,
            engine.max_model_len,
            f"{engine.config.scheduler} scheduler",
        )
        freeze_startup_heap()
        self._post(self._set_ready)
        try:
            self._serve(engine)
        except Exception as error:
            logger.exception("the engine loop stopped")
            self._post(self._set_failed, error)
        finally:
            gc.unfreeze()
            engine.close()

    def _engine_died(self, error: BaseException) -> None:
        with self._wakeup:
            self._dead = error
            self._wakeup.notify()

    def _warm_up(self, engine: LLMEngine) -> None:
        warm_up(engine)
        self._baseline = self._stats = engine.stats()

    def _serve(self, engine: LLMEngine) -> None:
        live: set[str] = set()
        while True:
            with self._wakeup:
                while not (
                    self._commands or self._stopping or self._dead or engine.has_unfinished_requests()
                ):
                    self._wakeup.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            if self._dead is not None:
                raise self._dead
            failures: list[tuple[str, BaseException]] = []
            for command in commands:
                if isinstance(command, _Abort):
                    if command.request_id in live:
                        live.discard(command.request_id)
                        engine.abort(command.request_id)
                    continue
                request = command.request
                try:
                    params = replace(request.params, output_kind="delta")
                    engine.add_request(request.request_id, request.prompt_token_ids, params)
                    live.add(request.request_id)
                except Exception as error:
                    logger.warning("request %s rejected by the engine: %s", request.request_id, error)
                    failures.append((request.request_id, RequestFailedError(str(error))))
            if stopping:
                for request_id in live:
                    engine.abort(request_id)
                self._stats = engine.stats()
                return
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except EngineDeadError:
                    raise  # nothing can run any more: fail everything (see _thread_main)
                except Exception as error:
                    logger.exception("engine step failed; failing the %d requests in the engine", len(live))
                    for request_id in live:
                        engine.abort(request_id)
                        failures.append((request_id, RequestFailedError(f"engine step failed: {error}")))
                    live.clear()
                live.difference_update(output.request_id for output in outputs if output.finished)
            self._stats = engine.stats()
            if outputs or failures:
                self._hand_over(outputs, failures)
