"""inflight's own engine, with the continuous and the static scheduler on the same model and KV pool."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from inflight.bench.system import BenchSettings, System, SystemRun, resident_mib
from inflight.bench.workload import BLOCK_SIZE, BenchRequest, kv_blocks_for
from inflight.engine.config import SchedulerPolicy
from inflight.engine.sequence import GuidedDecoding


def _available(settings: BenchSettings) -> str | None:
    return None


def _runner(scheduler: SchedulerPolicy) -> Callable[[BenchSettings], SystemRun]:
    def run(settings: BenchSettings) -> SystemRun:
        from inflight import LLM, SamplingParams
        from inflight.engine.warmup import warm_up

        num_kv_blocks = kv_blocks_for(settings.requests, settings.max_slots)
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
            kv_cache_dtype=settings.kv_cache_dtype,
        )
        # The server's warm-up (a full prefill step, then a decode step), untimed.
        warm_up(llm.engine)
        setup = time.perf_counter() - start
        # This process's resident memory with the model loaded and the KV pool allocated (the process
        # also holds whatever the systems benchmarked before it left behind).
        rss_mib = resident_mib()

        params = [
            SamplingParams(
                max_tokens=r.output_len,
                temperature=r.temperature,
                top_p=r.top_p,
                ignore_eos=True,
                guided=_guided(r),
            )
            for r in settings.requests
        ]
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate([r.prompt_token_ids for r in settings.requests], params)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        llm.close()
        config = {
            "scheduler": scheduler,
            "max_slots": settings.max_slots,
            "num_kv_blocks": num_kv_blocks,
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "kv_cache_dtype": settings.kv_cache_dtype,
            "quantization": settings.quantization,
            "model": str(settings.inflight_model or settings.model_dir),
            "rss_mib_after_load": rss_mib,
        }
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        return SystemRun(token_ids, seconds, setup, config, cpu_seconds)

    return run


def _guided(request: BenchRequest) -> GuidedDecoding | None:
    if request.schema is None:
        return None
    return GuidedDecoding("json_schema", json.dumps(request.schema))


STATIC = System(
    name="inflight-static",
    description="inflight engine, StaticScheduler (a batch runs until its longest member finishes)",
    unavailable=_available,
    run=_runner("static"),
    takes_schemas=True,
)
CONTINUOUS = System(
    name="inflight-continuous",
    description="inflight engine, ContinuousScheduler (finished slots refilled on the next step)",
    unavailable=_available,
    run=_runner("continuous"),
    takes_schemas=True,
)
