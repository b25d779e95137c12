"""The static-vs-continuous demo: the page, the simulation endpoint, and a real run on the live engine.

- `GET /demo`: one self-contained HTML page (no CDN), drawn from the two JSON endpoints below.
- `GET /v1/demo/simulate?slots=N`: both policies on the fixed 30-request workload, simulated with the
  engine's real schedulers on a virtual clock priced by the step cost model (`app.state.demo_cost_model`,
  set by `inflight demo`; the built-in default otherwise). Open like the page: it touches no model.
- `POST /v1/demo/run` `{"slots": N}`: the same requests run for real through the loaded model, once
  per policy, each with its own engine (scheduler + KV cache) sharing the live engine's weights; behind
  the API key like every model route. One run at a time.
- `GET /v1/demo/run/progress`: how far that run is (policy, requests done, output tokens/s so far), for
  the page to show while it waits (a run takes a minute or two on a CPU); behind the key as well.
"""

from __future__ import annotations

import asyncio
import threading
from importlib.resources import files
from typing import Annotated

from fastapi import APIRouter, Query, Request, Security
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from inflight.server.auth import API_KEY
from inflight.server.context import Context
from inflight.server.errors import APIError, error_responses
from inflight.sim.comparison import DemoComparison
from inflight.sim.cost_model import DEFAULT_COST_MODEL, CostModel
from inflight.sim.live import LiveProgress, run_live_demo
from inflight.sim.simulator import MAX_SLOTS, MIN_SLOTS, simulate_demo
from inflight.sim.timeline import Policy

demo_router = APIRouter(tags=["demo"])
_run_lock = threading.Lock()
_run_progress: LiveProgress | None = None  # the run in progress, while one is


class DemoRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slots: int = Field(8, ge=MIN_SLOTS, le=MAX_SLOTS, description="slots (max running sequences) per engine")


class DemoRunProgress(BaseModel):
    running: bool
    policy: Policy | None = Field(
        default=None, description="the policy running now (static first, then continuous)"
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


@demo_router.post(
    "/v1/demo/run",
    response_model=DemoComparison,
    responses=error_responses(400, 401, 429, 503),
    dependencies=[Security(API_KEY)],
    summary="Run the demo workload for real on the loaded model, once per policy",
)
async def run_endpoint(body: DemoRunRequest, ctx: Context) -> DemoComparison:
    if ctx.engine.state != "ready":
        raise APIError(
            503, f"The engine is {ctx.engine.state}; retry once it is ready.", headers={"Retry-After": "5"}
        )
    if not _run_lock.acquire(blocking=False):
        raise APIError(
            429, "A demo run is already in progress; retry when it finishes.", headers={"Retry-After": "10"}
        )
    global _run_progress
    _run_progress = LiveProgress()
    try:
        return await asyncio.to_thread(run_live_demo, ctx.engine.engine, body.slots, _run_progress)
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
        requests_done=progress.requests_done,
        requests_total=progress.requests_total,
        output_tokens=progress.output_tokens,
        tokens_per_s=progress.output_tokens / elapsed if elapsed > 0 else 0.0,
    )
