"""LLMEngine: one step = schedule -> run the model -> update sequences; requests in, outputs out.

By default outputs carry cumulative state: each `CompletionOutput` holds all token ids, text and
logprobs generated so far. A request with `SamplingParams.output_kind="delta"` gets only what is new
since its previous output instead (the server's contract: no step copies a request's whole output, and
unread deltas merge with `RequestOutput.merge`). A step returns an
output for every request that gained a token or finished this step (including failed requests:
finish_reason "error", `CompletionOutput.error` / `RequestOutput.error` say why). A request fails alone,
the rest of the batch carrying on, when it can never fit, or when its own sampling or output processing
raises inside a step. Aborted requests produce no further output.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inflight.engine.config import EngineConfig
from inflight.engine.cpu_linear import can_prepack, prepack_linears
from inflight.engine.kv_budget import kv_block_bytes, kv_budget_bytes
from inflight.engine.kv_cache import KVCacheManager
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.llama import allocate_kv_caches
from inflight.engine.model.loader import load_model
from inflight.engine.parallel.group import TensorParallelGroup
from inflight.engine.runner import ModelRunner, RunnerOutput
from inflight.engine.sampler import Sampler, SampleResult
from inflight.engine.scheduler import SchedulerOutput, create_scheduler
from inflight.engine.sequence import FinishReason, PositionLogprobs, SamplingParams, Sequence
from inflight.engine.stats import EngineStats
from inflight.engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("inflight.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionOutput:
    """One of a request's n completions, cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended it (None for EOS, length, abort, error).
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    # Why this completion failed (finish_reason "error"), else None.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionOutput) -> None:
        """Append a later delta of the same completion to this one (in place)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *later.logprobs]
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.cumulative_logprob = later.cumulative_logprob
        self.error = later.error


@dataclass
class RequestMetrics:
    """time.monotonic() timestamps (arrival as given to add_request)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Why the request failed (a completion with finish_reason "error"), else None.
    error: str | None = None

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta output of the same request into this one (in place): what a consumer that
        has not read this one yet would have seen in both."""
        for completion, more in zip(self.outputs, later.outputs, strict=True):
            completion.merge(more)
        self.finished = later.finished
        self.metrics = later.metrics
        self.error = later.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence | None]
    detokenizers: list[IncrementalDetokenizer]
    texts: list[str] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_counted: bool = False
    # Delta outputs: per completion, tokens and characters of text already sent; prompt logprobs sent.
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        parent = self.seqs[0]
        assert parent is not None
        if parent.num_forks_pending and parent.is_finished:
            return True
        return all(s is not None and s.is_finished for s in self.seqs)


class LLMEngine:
    """Continuous batching over a paged KV cache for one Llama-family checkpoint folder."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        share_model_of: LLMEngine | None = None,
    ) -> None:
        """`share_model_of`: reuse that engine's loaded weights and tokenizer (same model_dir, device, dtype)
        instead of loading them again; this engine still has its own scheduler and KV cache."""
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.device = torch.device(
            config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype_name = config.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = DTYPES[dtype_name]
        # Ranks 1..N-1 of a tensor-parallel engine (see parallel/group.py); None without.
        self.workers = (
            TensorParallelGroup.start(self.model_dir, config, self.dtype, self.device)
            if config.tensor_parallel_size > 1
            else None
        )
        try:
            self._build(share_model_of)
        except BaseException:
            self.close()
            raise

    def _build(self, donor: LLMEngine | None) -> None:
        config = self.config
        # A tensor-parallel engine always loads its own shard.
        shares = donor is not None and (donor.device, donor.dtype) == (self.device, self.dtype)
        if donor is None or not shares or self.workers is not None:
            self.tokenizer = Tokenizer.from_path(self.model_dir)
            self.model = load_model(
                self.model_dir, self.dtype, self.device, world_size=config.tensor_parallel_size
            )
            if can_prepack(self.device, self.dtype):
                prepack_linears(self.model, batch_size_hint=config.max_num_seqs)
        else:
            self.tokenizer, self.model = donor.tokenizer, donor.model
        self.model_config: ModelConfig = self.model.config
        self.eos_token_ids = frozenset(self.tokenizer.all_eos_ids) | frozenset(self.model_config.eos_token_id)
        self.num_kv_blocks = self._plan_num_blocks()
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            self.num_kv_blocks * config.block_size,
        )
        self.kv_cache = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = create_scheduler(
            config.scheduler,
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_queue=config.max_queue,
        )
        kv_caches = allocate_kv_caches(
            self.model_config,
            self.num_kv_blocks,
            config.block_size,
            self.dtype,
            self.device,
            self.model.layout.kv_heads,
        )
        # Parameter bytes held by each tensor-parallel rank (one entry without tensor parallelism).
        self.parameter_bytes_per_rank = [sum(p.numel() * p.element_size() for p in self.model.parameters())]
        if self.workers is not None:
            self.workers.allocate(self.num_kv_blocks)
            self.parameter_bytes_per_rank += self.workers.parameter_bytes
            logger.info(
                "tensor parallel: %d ranks, parameter bytes per rank: %s",
                config.tensor_parallel_size,
                ", ".join(f"{b / 2**20:.1f} MiB" for b in self.parameter_bytes_per_rank),
            )
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            self.kv_cache,
            Sampler(config.seed, self.device),
            self.device,
            broadcast=self.workers,
        )
        self._requests: dict[str, _Request] = {}
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_step_tokens = 0
        self._num_generate_calls = 0

    @classmethod
    def from_config(cls, model_dir: str | Path, **overrides: object) -> LLMEngine:
        return cls(model_dir, EngineConfig.model_validate(overrides))

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); no step may run afterwards."""
        if self.workers is not None:
            self.workers.close()

    def set_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` runs (on another thread) when a tensor-parallel rank dies between steps."""
        if self.workers is not None:
            self.workers.on_failure = callback

    def _plan_num_blocks(self) -> int:
        """The KV pool size: `num_kv_blocks` if given, else what fits the memory budget.

        On a GPU the budget is re-measured (free memory x gpu_memory_utilization); a requested pool larger
        than that (a plan made from node labels, say) is cut to what fits, and the log says so.
        """
        mc = self.model_config
        bytes_per_block = kv_block_bytes(mc, self.model.layout.kv_heads, self.config.block_size, self.dtype)
        budget = kv_budget_bytes(self.config, self.device)
        fit = int(budget // bytes_per_block)
        if self.workers is not None:
            # Every rank measured its own memory; the pool is the same size everywhere: the smallest.
            fit = self.workers.smallest_fit(fit)
        max_len = min(self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        blocks = choose_num_kv_blocks(
            requested=self.config.num_kv_blocks,
            fit=fit,
            enough=self.config.max_num_seqs * math.ceil(max_len / self.config.block_size),
            measured=self.device.type == "cuda",
        )
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache ({budget / 2**30:.2f} GiB available, one block needs "
                f"{bytes_per_block} bytes); set num_kv_blocks or free memory"
            )
        if self.config.num_kv_blocks is not None and blocks < self.config.num_kv_blocks:
            logger.warning(
                "asked for %d KV blocks, but only %d fit in free GPU memory (gpu_memory_utilization %.2f); "
                "using %d",
                self.config.num_kv_blocks,
                blocks,
                self.config.gpu_memory_utilization,
                blocks,
            )
        else:
            logger.info("KV cache: %d blocks of %d tokens", blocks, self.config.block_size)
        return blocks

    # ---- requests

    def capacity_error(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
        """Why a request of this size can never run on this engine (None if it can); for early 400s."""
        return self.scheduler.capacity_error(num_prompt_tokens, params.max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for a duplicate id or a token id outside the vocabulary,
        QueueFullError when the waiting queue is at max_queue."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        seq = Sequence(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=seq.arrival_time),
            seqs=[seq] + [None] * (params.n - 1),
            detokenizers=[
                IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                for _ in range(params.n)
            ],
            texts=[""] * params.n,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            sent_tokens=[0] * params.n,
            sent_chars=[0] * params.n,
        )

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored."""
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- one step

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        now = time.monotonic()
        for item in out.scheduled:
            request = self._requests[item.seq.request_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        result = self.runner.execute(out)
        for seq_id, reason in result.failed.items():  # one request's failure ends that request only
            self.scheduler.finish(seq_id, "error", error=reason)
        forked = self.scheduler.update(
            out, {sid: [s.token_id for s in r] for sid, r in result.samples.items()}
        )
        for child in forked:
            self._requests[child.request_id].seqs[child.index] = child
        self._last_step_tokens = out.num_batched_tokens
        return self._process(out, result)

    def _process(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        progressed: dict[str, _Request] = {}
        for seq_id, (first_token, chunk) in result.prompt_logprobs.items():
            request = self._requests[seq_id]
            # A recompute after preemption repeats chunks already recorded: keep each position once.
            if request.prompt_logprobs is not None and len(request.prompt_logprobs) == first_token:
                request.prompt_logprobs.extend(chunk)
        for item in out.sampling:
            parent = item.seq
            request = self._requests[parent.request_id]
            progressed[request.request_id] = request
            samples = result.samples.get(parent.seq_id)
            if samples is None:  # its draw failed: already finished with "error"
                continue
            members = [parent] if len(samples) == 1 else [s for s in request.seqs if s is not None]
            try:
                for member, sample in zip(members, samples, strict=True):
                    self._record_sample(request, member, sample)
            except Exception as error:
                logger.warning(
                    "request %s failed: processing its tokens raised %r", request.request_id, error
                )
                self._fail(request, f"processing this request's output failed: {error}")
                continue
            if not request.prompt_counted:
                request.prompt_counted = True
                self._num_prompt_tokens += len(request.prompt_token_ids)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
        for seq in out.failed:
            if seq.request_id in self._requests:
                progressed[seq.request_id] = self._requests[seq.request_id]
        outputs = []
        for request in progressed.values():
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                del self._requests[request.request_id]
            outputs.append(self._output(request, finished))
        return outputs

    def _record_sample(self, request: _Request, member: Sequence, sample: SampleResult) -> None:
        self._num_generation_tokens += 1
        if member.params.logprobs is not None:
            if member.logprobs is None:
                member.logprobs = []
            assert sample.top_logprobs is not None
            for token_id, logprob in sample.top_logprobs.items():
                logprob.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
            member.logprobs.append(sample.top_logprobs)
            member.cumulative_logprob += sample.logprob
        self._detokenize(request, member)

    def _fail(self, request: _Request, reason: str) -> None:
        """End every unfinished sequence of the request with finish_reason "error"; free their blocks."""
        for seq in request.seqs:
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq.seq_id, "error", error=reason)

    def _detokenize(self, request: _Request, seq: Sequence) -> None:
        detok = request.detokenizers[seq.index]
        before = len(detok.text)
        detok.add(seq.output_token_ids[-1])
        if seq.is_finished:
            detok.flush()
        stops = seq.params.stop_strings
        if stops and len(detok.text) > before:
            # Only text that this token added can complete a stop string.
            search_from = max(0, before - max(len(s) for s in stops) + 1)
            found = [(i, s) for s in stops if (i := detok.text.find(s, search_from)) >= 0]
            if found:
                index, stop = min(found)
                detok.text = detok.text[:index]
                if not seq.is_finished:
                    self.scheduler.finish(seq.seq_id, "stop", stop_reason=stop)
                elif seq.finish_reason == "length":
                    seq.finish("stop", stop_reason=stop)
        request.texts[seq.index] = detok.text

    def _output(self, request: _Request, finished: bool) -> RequestOutput:
        parent = request.seqs[0]
        assert parent is not None
        delta = request.params.output_kind == "delta"
        completions = []
        for index, seq in enumerate(request.seqs):
            if seq is None:  # a sibling not forked yet (the parent failed before its prompt finished)
                completions.append(CompletionOutput(index, "", [], parent.finish_reason, error=parent.error))
                continue
            text = request.texts[index]
            stops = seq.params.stop_strings
            if stops and not seq.is_finished:
                # Hold back a tail that may still grow into a stop string.
                text = text[: max(0, len(text) - max(len(s) for s in stops) + 1)]
            token_ids, logprobs = seq.output_token_ids, seq.logprobs
            if delta:
                sent, sent_chars = request.sent_tokens[index], request.sent_chars[index]
                request.sent_tokens[index], request.sent_chars[index] = (
                    len(token_ids),
                    max(sent_chars, len(text)),
                )
                token_ids, text = token_ids[sent:], text[sent_chars:]
                if logprobs is not None:
                    seq.logprobs = []  # they go out now: the engine keeps none of them
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=None if logprobs is None else list(logprobs),
                    cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                    error=seq.error,
                )
            )
        prompt_logprobs = None if request.prompt_logprobs is None else list(request.prompt_logprobs)
        if delta and request.sent_prompt_logprobs:
            prompt_logprobs = None
        request.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=request.metrics,
            prompt_logprobs=prompt_logprobs,
            error=next((c.error for c in completions if c.error is not None), None),
        )

    # ---- figures and the offline loop

    def stats(self) -> EngineStats:
        kv = self.kv_cache.stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_used_blocks=kv.num_used_blocks,
            num_blocks=kv.num_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions_total,
            num_prefix_cache_queries=kv.prefix_cache_queries,
            num_prefix_cache_hits=kv.prefix_cache_hits,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_steps=self.scheduler.num_steps,
            last_step_num_batched_tokens=self._last_step_tokens,
            max_num_seqs=self.config.max_num_seqs,
        )

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one finished output per prompt, in order.

        `on_progress(num_finished)` is called after every step.
        """
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        self._num_generate_calls += 1
        ids = [f"generate-{self._num_generate_calls}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
                self.add_request(request_id, prompt, p)
        except Exception:
            # All or nothing: a bad prompt leaves none of this call's requests behind.
            for request_id in ids:
                self.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.step():
                if output.finished:
                    done[output.request_id] = output
            if on_progress is not None:
                on_progress(len(done))
        return [done[i] for i in ids]


def choose_num_kv_blocks(requested: int | None, fit: int, enough: int, measured: bool) -> int:
    """Blocks for the KV pool: the request if given (cut to `fit` when `fit` was measured on the device),
    else what fits, capped at `enough` (every slot at full length)."""
    if requested is None:
        return min(fit, enough)
    return min(requested, fit) if measured else requested
