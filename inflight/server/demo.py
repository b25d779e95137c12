"""The static-vs-continuous demo: the page, the simulation endpoint, and a real run on the live engine.

- `GET /demo`: one self-contained HTML page (no CDN), drawn from the two JSON endpoints below.
- `GET /v1/demo/simulate?slots=N`: both policies on the fixed 30-request workload, simulated with the
  engine's real schedulers on a virtual clock priced by the step cost model (`app.state.demo_cost_model`,
  set by `inflight demo`; the built-in default otherwise). Open like the page: it touches no model.
- `GET /v1/demo/memory?budget_mib=M&reserve=R`: the same requests on M MiB of KV memory, served by
  contiguous per-request reservations (R: max_model_len or prompt_plus_max_tokens) and by the engine's
  paged `KVCacheManager`, both with the continuous scheduler on the virtual clock. Open like the page.
- `GET /v1/demo/serving?model=&gpu=&gpus=&prompt_tokens=&output_tokens=[&max_output_tokens=&requests_per_s=]`:
  what a replica of a catalog model on catalog GPUs serves (the sizing plan and the roofline cost model
  of `inflight size --workload`). Open like the page.
- `POST /v1/demo/run` `{"slots": N}`: the same requests run for real through the loaded model, once
  per policy, each with its own engine (scheduler + KV cache) sharing the live engine's weights; behind
  the API key like every model route. One run at a time.
- `POST /v1/demo/memory/run` `{"budget_mib": M, "reserve": R}`: the memory panel's requests run for real
  through the loaded model, once per KV allocator (contiguous, then paged), each engine's KV pool cut to
  the budget's tokens; behind the key, and one live run (of either kind) at a time.
- `GET /v1/demo/run/progress`: how far the live run in progress is (policy or allocator, requests done,
  output tokens/s so far), for the page to show while it waits (a run takes a minute or two on a CPU);
  behind the key as well.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from importlib.resources import files
from typing import Annotated, TypeVar

from fastapi import APIRouter, Query, Request, Security
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from inflight.openai_errors import APIError, bad_request, error_responses
from inflight.server.auth import API_KEY
from inflight.server.context import Context
from inflight.sim.comparison import DemoComparison
from inflight.sim.cost_model import DEFAULT_COST_MODEL, CostModel
from inflight.sim.live import LiveProgress, run_live_demo
from inflight.sim.live_memory import run_live_memory
from inflight.sim.memory import (
    DEFAULT_BUDGET_MIB,
    MAX_BUDGET_MIB,
    MIN_BUDGET_MIB,
    Allocator,
    MemoryComparison,
    Reserve,
    simulate_memory_demo,
)
from inflight.sim.serving import ServingAnswer, UnknownChoice, Workload, answer
from inflight.sim.simulator import MAX_SLOTS, MIN_SLOTS, simulate_demo
from inflight.sim.timeline import Policy

Result = TypeVar("Result")
demo_router = APIRouter(tags=["demo"])
_run_lock = threading.Lock()
_run_progress: LiveProgress | None = None  # the run in progress, while one is


class DemoRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slots: int = Field(8, ge=MIN_SLOTS, le=MAX_SLOTS, description="slots (max running sequences) per engine")


class MemoryRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget_mib: int = Field(
        DEFAULT_BUDGET_MIB, ge=MIN_BUDGET_MIB, le=MAX_BUDGET_MIB, description="KV memory budget in MiB"
    )
    reserve: Reserve = Field("max_model_len", description="what a contiguous request reserves up front")


class DemoRunProgress(BaseModel):
    running: bool
    policy: Policy | None = Field(
        default=None, description="the policy running now (static first, then continuous)"
    )
    allocator: Allocator | None = Field(
        default=None, description="in a memory run: the KV allocator running now (contiguous, then paged)"
    )
    requests_done: int = 0
    requests_total: int = 0
    output_tokens: int = Field(default=0, description="tokens the current policy generated so far")
    tokens_per_s: float = Field(default=0.0, description="the current policy's output tokens/s so far")


def demo_cost_model(request: Request) -> CostModel:
    cost_model = getattr(request.app.state, "demo_cost_model", None)
    return cost_model if isinstance(cost_model, CostModel) else DEFAULT_COST_MODEL


@demo_router.get("/demo", response_class=HTMLResponse, summary="Static vs continuous batching, side by side")
async def demo_page() -> HTMLResponse:
    page = files("inflight.server").joinpath("static/demo.html").read_text(encoding="utf-8")
    return HTMLResponse(page)


@demo_router.get(
    "/v1/demo/simulate",
    response_model=DemoComparison,
    responses=error_responses(400),
    summary="Both scheduling policies on the demo workload, on a virtual clock",
)
def simulate_endpoint(
    request: Request,
    slots: Annotated[int, Query(ge=MIN_SLOTS, le=MAX_SLOTS, description="slots (max running sequences)")] = 8,
) -> DemoComparison:
    # A plain def: FastAPI runs it in its thread pool, so a first-time simulation never blocks the loop.
    return simulate_demo(slots, demo_cost_model(request))


@demo_router.get(
    "/v1/demo/memory",
    response_model=MemoryComparison,
    responses=error_responses(400),
    summary="Contiguous vs paged KV memory on the demo workload, on a virtual clock",
)
def memory_endpoint(
    request: Request,
    budget_mib: Annotated[
        int, Query(ge=MIN_BUDGET_MIB, le=MAX_BUDGET_MIB, description="KV memory budget in MiB")
    ] = DEFAULT_BUDGET_MIB,
    reserve: Annotated[
        Reserve, Query(description="what the contiguous allocator reserves per request up front")
    ] = "max_model_len",
) -> MemoryComparison:
    return simulate_memory_demo(budget_mib, reserve, demo_cost_model(request))


MAX_WORKLOAD_TOKENS = 131072


@demo_router.get(
    "/v1/demo/serving",
    response_model=ServingAnswer,
    responses=error_responses(400),
    summary="What a replica of a catalog model on catalog GPUs serves: a cost model, not a measurement",
)
def serving_endpoint(
    model: Annotated[str, Query(description="catalog model")] = "meta-llama/Llama-3.1-70B",
    gpu: Annotated[str, Query(description="catalog GPU type with speed figures")] = "H100-80GB",
    gpus: Annotated[int, Query(ge=1, le=8, description="GPUs per replica (tensor parallel)")] = 4,
    prompt_tokens: Annotated[int, Query(ge=1, le=MAX_WORKLOAD_TOKENS)] = 512,
    output_tokens: Annotated[int, Query(ge=1, le=MAX_WORKLOAD_TOKENS, description="mean output")] = 256,
    max_output_tokens: Annotated[int | None, Query(ge=1, le=MAX_WORKLOAD_TOKENS)] = 1024,
    requests_per_s: Annotated[float | None, Query(gt=0, le=1e6, description="target rate")] = 50.0,
) -> ServingAnswer:
    workload = Workload(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        max_output_tokens=max_output_tokens,
        requests_per_s=requests_per_s,
    )
    try:
        return answer(model, gpu, gpus, workload)
    except UnknownChoice as error:
        raise bad_request(str(error), param=error.param) from None


@demo_router.post(
    "/v1/demo/run",
    response_model=DemoComparison,
    responses=error_responses(400, 401, 429, 503),
    dependencies=[Security(API_KEY)],
    summary="Run the demo workload for real on the loaded model, once per policy",
)
async def run_endpoint(body: DemoRunRequest, ctx: Context) -> DemoComparison:
    return await _live_run(ctx, lambda progress: run_live_demo(ctx.engine.engine, body.slots, progress))


@demo_router.post(
    "/v1/demo/memory/run",
    response_model=MemoryComparison,
    responses=error_responses(400, 401, 429, 503),
    dependencies=[Security(API_KEY)],
    summary="Run the memory panel's requests for real on the loaded model, once per KV allocator",
)
async def memory_run_endpoint(body: MemoryRunRequest, ctx: Context) -> MemoryComparison:
    return await _live_run(
        ctx, lambda progress: run_live_memory(ctx.engine.engine, body.budget_mib, body.reserve, progress)
    )


async def _live_run(ctx: Context, run: Callable[[LiveProgress], Result]) -> Result:
    """`run` on a worker thread with the progress the page polls; one live run at a time."""
    if ctx.engine.state != "ready":
        raise APIError(
            503, f"The engine is {ctx.engine.state}; retry once it is ready.", headers={"Retry-After": "5"}
        )
    if not _run_lock.acquire(blocking=False):
        raise APIError(
            429, "A demo run is already in progress; retry when it finishes.", headers={"Retry-After": "10"}
        )
    global _run_progress
    _run_progress = progress = LiveProgress()
    try:
        return await asyncio.to_thread(run, progress)
    finally:
        _run_progress = None
        _run_lock.release()


@demo_router.get(
    "/v1/demo/run/progress",
    response_model=DemoRunProgress,
    responses=error_responses(401),
    dependencies=[Security(API_KEY)],
    summary="How far the real run in progress is",
)
async def run_progress_endpoint() -> DemoRunProgress:
    progress = _run_progress
    if progress is None:
        return DemoRunProgress(running=False)
    elapsed = progress.elapsed_s
    return DemoRunProgress(
        running=True,
        policy=progress.policy,
        allocator=progress.allocator,
        requests_done=progress.requests_done,
        requests_total=progress.requests_total,
        output_tokens=progress.output_tokens,
        tokens_per_s=progress.output_tokens / elapsed if elapsed > 0 else 0.0,
    )
