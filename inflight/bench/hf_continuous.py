"""transformers' own continuous batching (`continuous_batching_context_manager`, paged cache, SDPA)."""

from __future__ import annotations

import importlib.util
import math
import time

from inflight.bench.hf_common import NO_EOS, WARMUP_TOKENS, load_model, pad_token_id, transformers_missing
from inflight.bench.system import BenchSettings, System, SystemRun
from inflight.bench.workload import longest_request

PAGE_SIZE = 256
# transformers' loop did best here with at most 32 requests per step (more made its steps slower overall).
MAX_REQUESTS_PER_BATCH = 32
RESULT_TIMEOUT_S = 600.0


def unavailable(settings: BenchSettings) -> str | None:
    missing = transformers_missing(settings)
    if missing is None and importlib.util.find_spec("psutil") is None:
        return "transformers' continuous batching needs psutil (pip install psutil)"
    return missing


def run(settings: BenchSettings) -> SystemRun:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    start = time.perf_counter()
    model = load_model(settings)
    longest = longest_request(settings.requests)
    max_requests = min(settings.max_slots, MAX_REQUESTS_PER_BATCH)
    # Sized explicitly: left to itself on CPU it reserves 60% of the machine's RAM for the cache.
    num_blocks = settings.max_slots * math.ceil(longest / PAGE_SIZE) + 1
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=settings.max_num_batched_tokens,
        max_requests_per_batch=max_requests,
    )
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.output_len for r in settings.requests),
        eos_token_id=NO_EOS,
        pad_token_id=pad_token_id(model),
    )

    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=generation_config, continuous_batching_config=cb_config, block=True
        ) as manager,
    ):

        def collect(expected: set[str]) -> dict[str, list[int]]:
            results: dict[str, list[int]] = {}
            while len(results) < len(expected):
                result = manager.get_result(timeout=RESULT_TIMEOUT_S)
                if result is None:
                    raise RuntimeError(
                        "transformers' continuous batching stopped before every request finished"
                    )
                if result.error:
                    raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                if result.is_finished() and result.request_id in expected:
                    results[result.request_id] = list(result.generated_tokens)
            return results

        manager.add_request(
            settings.requests[0].prompt_token_ids,
            request_id="warmup",
            max_new_tokens=WARMUP_TOKENS,
            eos_token_id=NO_EOS,
        )
        collect({"warmup"})
        setup = time.perf_counter() - start
        start = time.perf_counter()
        ids = [f"r{i}" for i in range(len(settings.requests))]
        for request_id, request in zip(ids, settings.requests, strict=True):
            manager.add_request(
                request.prompt_token_ids,
                request_id=request_id,
                max_new_tokens=request.output_len,
                eos_token_id=NO_EOS,
            )
        results = collect(set(ids))
        seconds = time.perf_counter() - start
    config = {
        "page_size": PAGE_SIZE,
        "num_blocks": num_blocks,
        "max_batch_tokens": settings.max_num_batched_tokens,
        "max_requests_per_batch": max_requests,
    }
    return SystemRun([results[i] for i in ids], seconds, setup, config)


SYSTEM = System(
    name="hf-continuous",
    description="transformers continuous batching (paged cache, SDPA)",
    unavailable=unavailable,
    run=run,
)
