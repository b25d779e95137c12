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
from pathlib import Path

import torch

from inflight.engine.config import EngineConfig
from inflight.engine.constraints import TokenConstraints
from inflight.engine.contiguous_kv import build_kv_allocator
from inflight.engine.cpu.allocator import retain_freed_memory
from inflight.engine.cpu.cpu_limit import fit_threads_to_cpu_limit
from inflight.engine.cpu.isa import cpu_isa
from inflight.engine.cpu.linear import can_prepack, prepare_linears
from inflight.engine.cpu.memory_limit import blocks_within_limit
from inflight.engine.draft import DraftProposer, check_same_vocabulary
from inflight.engine.dtypes import resolve_dtype_name
from inflight.engine.guided import GrammarCompiler, GrammarMatchers
from inflight.engine.kv_budget import (
    choose_num_kv_blocks,
    kv_block_bytes,
    kv_budget_bytes,
    kv_cache_dtype,
    step_activation_bytes,
)
from inflight.engine.loader import load_model, read_config
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.output_processor import OutputProcessor, RequestOutput
from inflight.engine.parallel.group import TensorParallelGroup
from inflight.engine.runner import ModelRunner, allocate_kv_caches
from inflight.engine.sampler import Sampler
from inflight.engine.scheduler import CapacityError, create_scheduler
from inflight.engine.sequence import SamplingParams, Sequence
from inflight.engine.speculative import NgramProposer, Proposer
from inflight.engine.stats import EngineStats
from inflight.engine.tokenizer import Tokenizer

logger = logging.getLogger("inflight.engine")


class LLMEngine:
    """Continuous batching over a paged KV cache for one Llama-family checkpoint folder."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        share_model_of: LLMEngine | None = None,
    ) -> None:
        """`share_model_of`: reuse that engine's loaded weights and tokenizer (same model_dir, device, dtype,
        quantization), and its draft model when both name the same one, instead of loading them again; this
        engine still has its own scheduler and KV caches."""
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.device = torch.device(
            config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        on_cuda = self.device.type == "cuda"
        native_bf16 = not on_cuda and cpu_isa().native_bfloat16
        self.dtype: torch.dtype = getattr(
            torch, resolve_dtype_name(config.dtype, on_cuda, native_cpu_bfloat16=native_bf16)
        )
        self.kv_dtype: torch.dtype = kv_cache_dtype(config, self.dtype)
        if self.device.type == "cpu":
            logger.info("CPU %s; running in %s", cpu_isa().describe(), str(self.dtype).removeprefix("torch."))
            retain_freed_memory()
            fit_threads_to_cpu_limit()
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
        shares = donor is not None and (donor.device, donor.dtype, donor.config.quantization) == (
            self.device,
            self.dtype,
            config.quantization,
        )
        if donor is None or not shares or self.workers is not None:
            self.tokenizer = Tokenizer.from_path(self.model_dir)
            self.model = load_model(
                self.model_dir,
                self.dtype,
                self.device,
                world_size=config.tensor_parallel_size,
                quantization=config.quantization,
            )
            if can_prepack(self.device, self.dtype):
                prepare_linears(self.model, config.max_num_seqs)
        else:
            self.tokenizer, self.model = donor.tokenizer, donor.model
        self.model_config: ModelConfig = self.model.config
        self.eos_token_ids = frozenset(self.tokenizer.all_eos_ids) | frozenset(self.model_config.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.draft_model: LlamaForCausalLM | None = (
            donor.draft_model
            if shares and donor is not None and donor.config.draft_model == config.draft_model
            else self._load_draft_model()
        )
        self.num_kv_blocks = self._plan_num_blocks(self.draft_model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            self.num_kv_blocks * config.block_size,
        )
        self.kv_cache = build_kv_allocator(
            config.kv_allocator,
            self.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            reserve=config.contiguous_reserve,
            waiting=lambda: self.scheduler.waiting,
        )
        self.scheduler = create_scheduler(
            config.scheduler,
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_merged_prefill_tokens=config.max_merged_prefill_tokens,
            max_prefill_tokens_while_decoding=config.prefill_tokens_while_decoding(
                self.device.type, self.model.layer_weights()
            ),
            proposer=self._proposer(self.draft_model),
        )
        logger.info(
            "prompt tokens a step computes while others decode: at most %s "
            "(--max-prefill-tokens-while-decoding)",
            self.scheduler.max_prefill_tokens_while_decoding,
        )
        kv_caches = allocate_kv_caches(
            self.model_config,
            self.num_kv_blocks,
            config.block_size,
            self.kv_dtype,
            self.device,
            self.model.layout.kv_heads,
        )
        # Parameter bytes held by each tensor-parallel rank (one entry without tensor parallelism).
        # (quantized weights count with their blocks and scales: model.weight_tensors())
        self.parameter_bytes_per_rank = [sum(t.nbytes for t in self.model.weight_tensors().values())]
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
            config.block_size,
            Sampler(config.seed, self.device),
            self.device,
            TokenConstraints(GrammarMatchers(self.grammars)),
            broadcast=self.workers,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self._last_step_tokens = 0
        self._num_generate_calls = 0

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); no step may run afterwards."""
        if self.workers is not None:
            self.workers.close()
        if hasattr(self, "runner"):
            self.runner.constraints.close()

    def set_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` runs (on another thread) when a tensor-parallel rank dies between steps."""
        if self.workers is not None:
            self.workers.on_failure = callback

    def _load_draft_model(self) -> LlamaForCausalLM | None:
        """The draft model of speculative='draft' (None otherwise), refused unless its vocabulary is the
        target's: checked from its config and tokenizer, before any of its weights are read."""
        config = self.config
        if config.speculative != "draft":
            return None
        assert config.draft_model is not None
        check_same_vocabulary(
            str(self.model_dir),
            self.tokenizer,
            self.model_config.vocab_size,
            config.draft_model,
            Tokenizer.from_path(config.draft_model),
            read_config(config.draft_model).vocab_size,
        )
        draft = load_model(config.draft_model, self.dtype, self.device, quantization=config.quantization)
        if can_prepack(self.device, self.dtype):
            prepare_linears(draft, config.max_num_seqs)
        return draft

    def _proposer(self, draft_model: LlamaForCausalLM | None) -> Proposer | None:
        config = self.config
        if config.speculative == "ngram":
            return NgramProposer.from_config(config)
        if draft_model is None:
            return None
        # As many blocks as the target's pool: the draft holds (at most) the same sequences' tokens.
        return DraftProposer(
            draft_model,
            self.num_kv_blocks,
            config.block_size,
            self.kv_dtype,
            self.device,
            num_tokens=config.num_speculative_tokens,
            max_running=config.speculative_max_running,
            seed=config.seed,
        )

    def _plan_num_blocks(self, draft_model: LlamaForCausalLM | None) -> int:
        """The KV pool size: `num_kv_blocks` if given, else what fits the memory budget.

        On a GPU the budget is re-measured (free memory x gpu_memory_utilization); a requested pool larger
        than that (a plan made from node labels, say) is cut to what fits, and the log says so. On CPU a
        pool that the container's memory limit (less the resident memory) or the machine's available memory
        has no room for, beside a step's activations, is cut the same way (cpu/memory_limit.py); with tensor
        parallelism every rank lives in that container and on that machine, so the resident memory and step
        activations are all ranks' and a block costs every rank's share of it. With a draft model, a block's
        bytes are the target's and the draft's (its pool has as many blocks): the draft takes its share of the
        budget by its bytes per token.
        """
        mc = self.model_config
        bytes_per_block = kv_block_bytes(
            mc, self.model.layout.kv_heads, self.config.block_size, self.kv_dtype
        )
        if draft_model is not None:
            bytes_per_block += kv_block_bytes(
                draft_model.config, draft_model.layout.kv_heads, self.config.block_size, self.kv_dtype
            )
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
        if self.device.type == "cpu":
            layout = self.model.layout
            # Every rank runs the step at once, and a rank's step is nearly the full one: the residual
            # stream and the all-reduced attention and MLP outputs are full width on every rank (its q/k/v
            # are its heads' share, which the formula's 4 x hidden counts whole: a little over), and
            # gather_vocab hands every rank the whole vocabulary's logits; only the MLP's intermediate
            # activations are the rank's share. So the formula with the rank's intermediate size, once per
            # rank (the figure sizing.activation_reserve_bytes plans per rank).
            step_bytes = layout.size * step_activation_bytes(
                mc.hidden_size,
                layout.intermediate,
                mc.vocab_size,
                self.config.max_num_batched_tokens,
                self.config.max_num_seqs,
                str(self.dtype).removeprefix("torch."),
            )
            # The ranks share the container: a block costs each rank's share of it (its KV heads), and
            # every rank's resident memory counts: the lead reads its workers' (/proc/PID/statm) as it
            # decides, after each reported its shard loaded, and only where there is a limit.
            pool_block_bytes = bytes_per_block
            worker_pids: list[int] = []
            if self.workers is not None:
                pool_block_bytes += sum(self.workers.block_bytes)
                worker_pids = self.workers.pids
            within = blocks_within_limit(pool_block_bytes, step_bytes, worker_pids)
            if within is not None and within[0] < blocks:
                if within[0] < 1:
                    raise ValueError(
                        f"no memory left for the KV cache within {within[1]} (one block needs "
                        f"{pool_block_bytes} bytes): raise the container's memory limit or free memory on "
                        "the machine, or use a smaller model, dtype or --quantization"
                    )
                logger.warning("%d KV blocks do not fit %s: using %d", blocks, within[1], within[0])
                return within[0]
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
            logger.info(
                "KV cache: %d blocks of %d tokens (%s)",
                blocks,
                self.config.block_size,
                str(self.kv_dtype).removeprefix("torch."),
            )
        return blocks

    # ---- requests

    def capacity_error(self, num_prompt_tokens: int, params: SamplingParams) -> CapacityError | None:
        """Why a request of this size can never run on this engine (None if it can); for early 400s."""
        return self.scheduler.capacity_error(num_prompt_tokens, params.max_tokens, params.n)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for a duplicate id or a token id outside the vocabulary."""
        params = params or SamplingParams()
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > 1 and self.config.kv_allocator == "contiguous":
            raise ValueError(
                f"n={params.n} shares KV blocks between completions; kv_allocator='contiguous' "
                "cannot, so send n=1 (or use kv_allocator='paged')"
            )
        if params.guided is not None:
            self.grammars.compile(params.guided)  # GrammarError (a ValueError) now, not at its first step
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
        self.outputs.add(seq, text)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored."""
        if self.outputs.remove(request_id):
            self.scheduler.abort(request_id)
            self.runner.constraints.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs) or self.scheduler.has_unfinished()

    # ---- one step

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        for seq_id, reason in result.failed.items():  # one request's failure ends that request only
            self.scheduler.finish(seq_id, "error", error=reason)
        forked = self.scheduler.update(
            out, {sid: [s.token_id for s in r] for sid, r in result.samples.items()}
        )
        self.outputs.add_forks(forked)
        self._last_step_tokens = out.num_batched_tokens
        outputs = self.outputs.process(out, result)
        for output in outputs:
            if output.finished:
                self.runner.constraints.release(output.request_id)
        return outputs

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
            num_prompt_tokens=self.outputs.num_prompt_tokens,
            num_generation_tokens=self.outputs.num_generation_tokens,
            num_steps=self.scheduler.num_steps,
            last_step_num_batched_tokens=self._last_step_tokens,
            max_num_seqs=self.config.max_num_seqs,
            num_draft_tokens=self.outputs.num_draft_tokens,
            num_accepted_tokens=self.outputs.num_accepted_tokens,
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
