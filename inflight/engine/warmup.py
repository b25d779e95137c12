"""One short request through a freshly loaded engine, so lazy initialisation (kernel builds, allocator
growth, first-call dispatch) is neither timed nor counted as real work (no torch at import)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.engine.sequence import SamplingParams

if TYPE_CHECKING:
    from inflight.engine.engine import LLMEngine

WARMUP_REQUEST_ID = "inflight-warmup"


def warm_up(engine: LLMEngine) -> None:
    """Run a two-token greedy request to the end (the engine must have no other requests)."""
    prompt = engine.tokenizer.encode("Warm up.")
    engine.add_request(
        WARMUP_REQUEST_ID, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
