"""inflight's own engine, with the continuous and the static scheduler on the same model and KV pool."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from inflight.bench.system import BenchSettings, System, SystemRun, resident_mib
from inflight.engine.config import SchedulerPolicy

BLOCK_SIZE = 16


def _available(settings: BenchSettings) -> str | None:
    return None


def _runner(scheduler: SchedulerPolicy) -> Callable[[BenchSettings], SystemRun]:
    def run(settings: BenchSettings) -> SystemRun:
        from inflight import LLM, SamplingParams
        from inflight.engine.warmup import warm_up

        longest = max(len(r.prompt_token_ids) + r.output_len for r in settings.requests)
        # Enough blocks for every slot's longest request: the comparison is of batching, not of preemption.
        num_kv_blocks = settings.max_slots * math.ceil(longest / BLOCK_SIZE) + 1
        start = time.perf_counter()
        llm = LLM(
            str(settings.inflight_model or settings.model_dir),
            quantization=settings.quantization,
            max_slots=settings.max_slots,
            num_kv_blocks=num_kv_blocks,
            block_size=BLOCK_SIZE,
            scheduler=scheduler,
            dtype=settings.dtype,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            tensor_parallel_size=settings.tensor_parallel_size,
        )
        # The server's warm-up (a full prefill step, then a decode step), untimed.
        warm_up(llm.engine)
        setup = time.perf_counter() - start
        # This process's resident memory with the model loaded and the KV pool allocated (the process
        # also holds whatever the systems benchmarked before it left behind).
        rss_mib = resident_mib()

        params = [
            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            for r in settings.requests
        ]
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in settings.requests], params)
        seconds = time.perf_counter() - start
        llm.close()
        config = {
            "scheduler": scheduler,
            "max_slots": settings.max_slots,
            "num_kv_blocks": num_kv_blocks,
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "quantization": settings.quantization,
            "model": str(settings.inflight_model or settings.model_dir),
            "rss_mib_after_load": rss_mib,
        }
        return SystemRun([list(o.outputs[0].token_ids) for o in outputs], seconds, setup, config)

    return run


STATIC = System(
    name="inflight-static",
    description="inflight engine, StaticScheduler (a batch runs until its longest member finishes)",
    unavailable=_available,
    run=_runner("static"),
)
CONTINUOUS = System(
    name="inflight-continuous",
    description="inflight engine, ContinuousScheduler (finished slots refilled on the next step)",
    unavailable=_available,
    run=_runner("continuous"),
)
