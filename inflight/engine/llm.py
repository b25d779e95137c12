"""`LLM`: the offline, vLLM-like face of the engine.

from inflight import LLM, SamplingParams
llm = LLM("models/tiny", max_slots=8)
for out in llm.generate(["Hello", "def main("], SamplingParams(max_tokens=32, temperature=0)):
    print(out.outputs[0].text)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from inflight.engine.config import DType, EngineConfig, SchedulerPolicy
from inflight.engine.engine import LLMEngine, RequestOutput
from inflight.engine.sequence import SamplingParams


class LLM:
    """Load a checkpoint folder once; `generate` runs batches of prompts through continuous batching.

    `max_slots` is how many sequences run together; `num_kv_blocks` None sizes the KV pool from memory.
    `llm.engine` is the underlying LLMEngine (stats: preemptions, prefix-cache hits, KV usage).
    `tensor_parallel_size` N > 1 splits the model over N ranks (worker processes; see
    docs/tensor-parallel.md); `close()` stops them (they also stop when this process exits).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        max_slots: int = 64,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        scheduler: SchedulerPolicy = "continuous",
        dtype: DType = "auto",
        device: str = "auto",
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        tensor_parallel_size: int = 1,
    ) -> None:
        config = EngineConfig(
            max_num_seqs=max_slots,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            scheduler=scheduler,
            dtype=dtype,
            device=device,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.engine = LLMEngine(model, config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order. Prompts are strings or token-id lists.

        `progress` prints finished requests and generated tokens/s to stderr about once a second.
        """
        prompt_list: list[str | list[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        reporter = _ProgressReporter(self.engine, len(prompt_list)) if progress else None
        outputs = self.engine.generate(prompt_list, sampling_params, on_progress=reporter)
        if reporter is not None:
            reporter.close()
        return outputs

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; the LLM cannot generate afterwards."""
        self.engine.close()


class _ProgressReporter:
    """Prints "done/total requests, tokens, tokens/s" to stderr at most once a second."""

    def __init__(self, engine: LLMEngine, total: int) -> None:
        self.engine = engine
        self.total = total
        self.start = self.last = time.monotonic()
        self.tokens_at_start = engine.stats().num_generation_tokens

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < 1.0 and done < self.total:
            return
        self.last = now
        tokens = self.engine.stats().num_generation_tokens - self.tokens_at_start
        rate = tokens / max(now - self.start, 1e-9)
        print(
            f"\r{done}/{self.total} requests, {tokens} tokens, {rate:.1f} tokens/s",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        print(file=sys.stderr)
