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
from typing import Any

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.output_processor import RequestOutput
from inflight.engine.sequence import SamplingParams


class LLM:
    """Load a checkpoint folder once; `generate` runs batches of prompts through continuous batching.

    `max_slots` is how many sequences run together; `num_kv_blocks` None sizes the KV pool from memory.
    `llm.engine` is the underlying LLMEngine (stats: preemptions, prefix-cache hits, KV usage).
    `tensor_parallel_size` N > 1 splits the model over N ranks (worker processes; see
    docs/tensor-parallel.md); `close()` stops them (they also stop when this process exits).
    Offline, no one reads a token as it comes, so unless `max_prefill_tokens_while_decoding` is given,
    prompts keep the step's whole token budget while others decode (throughput first; a server's CPU
    default holds them to fewer so that decodes do not wait).
    """

    def __init__(self, model: str | Path, *, max_slots: int | None = None, **settings: Any) -> None:
        """`settings` are EngineConfig's fields, with its defaults (`max_slots` is its `max_num_seqs`);
        a wrong name or value raises pydantic's ValidationError naming it."""
        if max_slots is not None:
            settings["max_num_seqs"] = max_slots
        config = EngineConfig(**settings)
        if config.max_prefill_tokens_while_decoding is None:
            offline = {"max_prefill_tokens_while_decoding": config.max_num_batched_tokens}
            config = config.model_copy(update=offline)
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
