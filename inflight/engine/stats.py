"""EngineStats: one snapshot of an engine (torch-free, so the server can hold one before the model loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """What runs and waits now, the KV pool, and running totals since the engine started."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    last_step_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    # Speculative decoding: tokens proposed, and those of them accepted (both 0 with it off).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
