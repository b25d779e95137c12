"""One request through a freshly loaded engine, so lazy initialisation (kernel builds, allocator growth,
first-call dispatch, oneDNN kernels for a full step's shapes) is neither timed nor counted as real work
(no torch at import)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.engine.sequence import SamplingParams

if TYPE_CHECKING:
    from inflight.engine.engine import LLMEngine

WARMUP_REQUEST_ID = "inflight-warmup"
WARMUP_OUTPUT_TOKENS = 2


def warmup_prompt_len(engine: LLMEngine) -> int:
    """As many prompt tokens as one step takes (`max_num_batched_tokens`), within the model's length and
    the KV pool (one block spare): the first real full step then runs on warm code and memory (on CPU,
    in a fresh process, that first step took 1.2x the next ones)."""
    config = engine.config
    pool_tokens = (engine.num_kv_blocks - 1) * config.block_size - WARMUP_OUTPUT_TOKENS
    longest = engine.max_model_len - WARMUP_OUTPUT_TOKENS
    return max(1, min(config.max_num_batched_tokens, longest, pool_tokens))


def warm_up(engine: LLMEngine) -> None:
    """Run a greedy request of `warmup_prompt_len` prompt tokens and two output tokens to the end (the
    engine must have no other requests): one full prefill step, one decode step."""
    words = engine.tokenizer.encode("Warm up.") or [0]
    length = warmup_prompt_len(engine)
    prompt = (words * (length // len(words) + 1))[:length]
    engine.add_request(
        WARMUP_REQUEST_ID,
        prompt,
        SamplingParams(max_tokens=WARMUP_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True),
    )
    while engine.has_unfinished_requests():
        engine.step()
