"""GET /demo, GET /v1/demo/simulate, POST /v1/demo/run and /v1/demo/memory/run on a live server (real
sockets)."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from inflight.sim.comparison import DemoComparison
from inflight.sim.cost_model import DEFAULT_COST_MODEL, CostModel
from inflight.sim.live import LiveProgress
from inflight.sim.memory import MemoryComparison, simulate_memory
from inflight.sim.serving import ServingAnswer, Workload, answer
from inflight.sim.simulator import simulate
from inflight.sim.workload import demo_workload

from support.demo_server import DemoServer


def test_simulate_returns_both_policies_with_timelines_and_the_ratio(demo_server: DemoServer) -> None:
    response = httpx.get(f"{demo_server.url}/v1/demo/simulate", params={"slots": 8})
    assert response.status_code == 200
    body = response.json()
    comparison = DemoComparison.model_validate(body)
    assert comparison == simulate(8, DEFAULT_COST_MODEL)
    workload = demo_workload()
    for policy in ("static", "continuous"):
        result = body[policy]
        assert result["policy"] == policy and result["slots"] == 8
        assert result["throughput_tokens_per_s"] == pytest.approx(
            sum(r.output_tokens for r in workload) / result["makespan_s"]
        )
        assert [r["request_id"] for r in result["requests"]] == [r.request_id for r in workload]
        for request in result["requests"]:
            assert set(request) >= {"admit_s", "first_token_s", "finish_s", "latency_s", "segments"}
            assert all(0 <= seg["slot"] < 8 for seg in request["segments"])
        for key in ("mean_latency_s", "p95_latency_s", "mean_ttft_s", "idle_slot_s", "idle_slot_fraction"):
            assert isinstance(result[key], float)
    assert body["throughput_ratio"] == pytest.approx(
        body["continuous"]["throughput_tokens_per_s"] / body["static"]["throughput_tokens_per_s"]
    )
    assert body["throughput_ratio"] >= 2.0
    assert f"{body['throughput_ratio']:.2f}x" in body["summary"]


def test_simulate_changes_with_slots_and_one_slot_makes_the_policies_equal(demo_server: DemoServer) -> None:
    one = httpx.get(f"{demo_server.url}/v1/demo/simulate?slots=1").json()
    four = httpx.get(f"{demo_server.url}/v1/demo/simulate?slots=4").json()
    # One at a time either way: the same steps; static in order of arrival, continuous shortest prompt first.
    assert one["static"]["steps"] == one["continuous"]["steps"]
    assert one["throughput_ratio"] == pytest.approx(1.0)
    by_admission = {
        policy: sorted(one[policy]["requests"], key=lambda r: r["admit_s"])
        for policy in ("static", "continuous")
    }
    assert [r["request_id"] for r in by_admission["static"]] == [
        r["request_id"] for r in one["static"]["requests"]
    ]
    assert [r["prompt_tokens"] for r in by_admission["continuous"]] == sorted(
        r["prompt_tokens"] for r in one["continuous"]["requests"]
    )
    assert four["continuous"]["throughput_tokens_per_s"] > one["continuous"]["throughput_tokens_per_s"]
    assert four["throughput_ratio"] > 1.5


def test_simulate_uses_the_app_cost_model(demo_server: DemoServer) -> None:
    demo_server.app.state.demo_cost_model = CostModel(fixed_s=1.0, per_token_s=0.0, source="1 s per step")
    try:
        body = httpx.get(f"{demo_server.url}/v1/demo/simulate?slots=8").json()
    finally:
        del demo_server.app.state.demo_cost_model
    assert body["cost_model"]["source"] == "1 s per step"
    assert body["static"]["makespan_s"] == body["static"]["steps"]


@pytest.mark.parametrize("slots", ["0", "33", "-1", "eight", "8.5", ""])
def test_simulate_rejects_bad_slots_with_an_openai_error(demo_server: DemoServer, slots: str) -> None:
    response = httpx.get(f"{demo_server.url}/v1/demo/simulate?slots={slots}")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "slots"
    assert error["message"]


@pytest.mark.parametrize(
    "body", [{"slots": 0}, {"slots": 33}, {"slots": "many"}, {"slots": 8, "policy": "static"}, [8]]
)
def test_run_rejects_bad_bodies_with_an_openai_error(demo_server: DemoServer, body: object) -> None:
    response = httpx.post(f"{demo_server.url}/v1/demo/run", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_run_rejects_malformed_json(demo_server: DemoServer) -> None:
    response = httpx.post(
        f"{demo_server.url}/v1/demo/run", content=b"{slots:", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_demo_page_is_self_contained(demo_server: DemoServer) -> None:
    response = httpx.get(f"{demo_server.url}/demo")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert 'id="slots"' in page and 'id="run"' in page and 'id="budget"' in page
    assert "/v1/demo/simulate" in page and "/v1/demo/run" in page and "/v1/demo/memory" in page
    assert "/v1/demo/serving" in page
    # No CDN: nothing is loaded from elsewhere (the only URL is the SVG namespace name).
    assert set(re.findall(r"https?://[^\s\"'`]+", page)) == {"http://www.w3.org/2000/svg"}
    assert "<script src" not in page
    # The one link is the icon, inline: the browser asks the server for no /favicon.ico (a 404 before).
    links = re.findall(r"<link [^>]*>", page)
    assert len(links) == 1 and links[0].startswith('<link rel="icon" href="data:image/svg+xml,'), links


def test_run_progress_says_how_far_the_real_run_is(
    demo_server: DemoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page polls it while POST /v1/demo/run runs: the policy, requests done, output tokens/s so far."""
    from inflight.server import demo

    halfway, finish = threading.Event(), threading.Event()

    def held_run(engine: object, slots: int, tracker: LiveProgress) -> DemoComparison:
        tracker.requests_total, tracker.policy, tracker.requests_done = 30, "static", 12
        tracker.output_tokens, tracker.elapsed_s = 600, 2.0
        halfway.set()
        assert finish.wait(60), "the test never let the run finish"
        return simulate(slots, DEFAULT_COST_MODEL)

    monkeypatch.setattr(demo, "run_live_demo", held_run)
    assert httpx.get(f"{demo_server.url}/v1/demo/run/progress").json() == {
        "running": False, "policy": None, "allocator": None, "requests_done": 0, "requests_total": 0,
        "output_tokens": 0, "tokens_per_s": 0.0,
    }  # fmt: skip
    run = threading.Thread(
        target=lambda: httpx.post(f"{demo_server.url}/v1/demo/run", json={"slots": 2}, timeout=60)
    )
    run.start()
    try:
        assert halfway.wait(60), "the run never started"
        progress = httpx.get(f"{demo_server.url}/v1/demo/run/progress").json()
    finally:
        finish.set()
        run.join(60)
    assert progress == {
        "running": True, "policy": "static", "allocator": None, "requests_done": 12, "requests_total": 30,
        "output_tokens": 600, "tokens_per_s": 300.0,
    }  # fmt: skip
    assert httpx.get(f"{demo_server.url}/v1/demo/run/progress").json()["running"] is False


def test_run_measures_both_policies_for_real_with_the_simulated_decisions(demo_server: DemoServer) -> None:
    # 32 slots: the fewest engine steps (the browser test runs 16); both policies admit everyone at once.
    response = httpx.post(f"{demo_server.url}/v1/demo/run", json={"slots": 32}, timeout=300)
    assert response.status_code == 200, response.text
    measured = DemoComparison.model_validate(response.json())
    simulated = simulate(32, DEFAULT_COST_MODEL)
    assert measured.kind == "measured" and measured.cost_model is None
    for policy in ("static", "continuous"):
        real, sim = getattr(measured, policy), getattr(simulated, policy)
        # The same scheduler decisions, only timed by the wall clock instead of the cost model.
        assert real.steps == sim.steps
        assert [(r.request_id, r.segments[0].slot) for r in real.requests] == [
            (r.request_id, r.segments[0].slot) for r in sim.requests
        ]
        assert real.output_tokens == sim.output_tokens
        assert real.throughput_tokens_per_s > 0
    assert measured.static.steps == measured.continuous.steps


def test_with_an_api_key_only_the_real_run_needs_it(demo_server: DemoServer) -> None:
    demo_server.app.state.api_key = "sekrit"
    try:
        assert httpx.get(f"{demo_server.url}/demo").status_code == 200
        assert httpx.get(f"{demo_server.url}/v1/demo/simulate?slots=2").status_code == 200
        for path, body in (("/v1/demo/run", {"slots": 2}), ("/v1/demo/memory/run", {"budget_mib": 64})):
            response = httpx.post(f"{demo_server.url}{path}", json=body)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
    finally:
        demo_server.app.state.api_key = None


def test_a_second_concurrent_run_gets_429(demo_server: DemoServer) -> None:
    from inflight.server import demo

    assert demo._run_lock.acquire(blocking=False)  # as if a run were in progress
    try:
        response = httpx.post(f"{demo_server.url}/v1/demo/run", json={"slots": 2})
    finally:
        demo._run_lock.release()
    assert response.status_code == 429
    assert response.headers["retry-after"] == "10"
    assert "already in progress" in response.json()["error"]["message"]


def test_memory_returns_both_allocators_per_step_and_the_headline(demo_server: DemoServer) -> None:
    response = httpx.get(f"{demo_server.url}/v1/demo/memory", params={"budget_mib": 256})
    assert response.status_code == 200
    body = response.json()
    comparison = MemoryComparison.model_validate(body)
    assert comparison == simulate_memory(256, "max_model_len", DEFAULT_COST_MODEL)
    assert body["reserve"] == "max_model_len" and body["budget_mib"] == 256
    for allocator in ("contiguous", "paged"):
        result = body[allocator]
        assert result["allocator"] == allocator
        assert result["capacity_tokens"] == 256 * 1024 * 1024 // body["kv_bytes_per_token"]
        assert len(result["steps"]) == result["num_steps"] > 0
        assert set(result["steps"][0]) == {
            "start_s",
            "end_s",
            "in_flight",
            "waiting",
            "reserved_tokens",
            "written_tokens",
        }
    assert body["in_flight_ratio"] >= 2.0
    assert f"{body['in_flight_ratio']:.1f}x" in body["summary"]


def test_memory_changes_with_the_budget_and_the_reservation(demo_server: DemoServer) -> None:
    small = httpx.get(f"{demo_server.url}/v1/demo/memory?budget_mib=64").json()
    large = httpx.get(f"{demo_server.url}/v1/demo/memory?budget_mib=1024").json()
    exact = httpx.get(f"{demo_server.url}/v1/demo/memory?budget_mib=64&reserve=prompt_plus_max_tokens").json()
    for allocator in ("contiguous", "paged"):
        assert large[allocator]["makespan_s"] < small[allocator]["makespan_s"]
    assert exact["contiguous"]["peak_in_flight"] > small["contiguous"]["peak_in_flight"] == 1
    assert exact["paged"] == small["paged"]


def test_serving_answers_the_plan_and_the_cost_model(demo_server: DemoServer) -> None:
    params = {"model": "llama-3.1-70b", "gpu": "H100-80GB", "gpus": 4, "prompt_tokens": 512}
    body = httpx.get(f"{demo_server.url}/v1/demo/serving", params=params).json()
    workload = Workload(prompt_tokens=512, output_tokens=256, max_output_tokens=1024, requests_per_s=50)
    assert ServingAnswer.model_validate(body) == answer("llama-3.1-70b", "H100-80GB", 4, workload)
    assert body["fits"] and body["estimate"]["replicas"] >= 1
    one = httpx.get(f"{demo_server.url}/v1/demo/serving", params={**params, "gpus": 1}).json()
    assert not one["fits"] and one["estimate"] is None and one["min_gpus"] == 2


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("memory?budget_mib=63", "budget_mib"),
        ("memory?budget_mib=1025", "budget_mib"),
        ("memory?budget_mib=lots", "budget_mib"),
        ("memory?budget_mib=", "budget_mib"),
        ("memory?reserve=everything", "reserve"),
        ("serving?model=gpt-5", "model"),
        ("serving?gpu=A10G", "gpu"),
        ("serving?gpus=0", "gpus"),
        ("serving?gpus=16", "gpus"),
        ("serving?prompt_tokens=0", "prompt_tokens"),
        ("serving?requests_per_s=-1", "requests_per_s"),
    ],
)
def test_memory_and_serving_reject_bad_parameters_with_an_openai_error(
    demo_server: DemoServer, query: str, param: str
) -> None:
    response = httpx.get(f"{demo_server.url}/v1/demo/{query}")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_memory_run_measures_both_allocators_with_the_simulated_decisions(demo_server: DemoServer) -> None:
    """The live engine, its KV pool cut to the budget's 128 blocks, once per allocator: every step holds the
    simulated requests in flight, waiting, blocks reserved and tokens written; only the clock differs."""
    response = httpx.post(f"{demo_server.url}/v1/demo/memory/run", json={"budget_mib": 256}, timeout=600)
    assert response.status_code == 200, response.text
    measured = MemoryComparison.model_validate(response.json())
    simulated = simulate_memory(256, "max_model_len", DEFAULT_COST_MODEL)
    assert measured.kind == "measured" and measured.cost_model is None and measured.live_model
    assert measured.summary.endswith("measured).")
    for allocator in ("contiguous", "paged"):
        real, sim = getattr(measured, allocator), getattr(simulated, allocator)
        assert real.capacity_tokens == sim.capacity_tokens == 2048
        assert real.num_steps == sim.num_steps and real.preemptions == sim.preemptions
        fields = ("in_flight", "waiting", "reserved_tokens", "written_tokens")
        assert [[getattr(step, f) for f in fields] for step in real.steps] == [
            [getattr(step, f) for f in fields] for step in sim.steps
        ]
        assert real.throughput_tokens_per_s > 0
    assert measured.paged.peak_in_flight > measured.contiguous.peak_in_flight == 4
    assert measured.paged.mean_in_flight > measured.contiguous.mean_in_flight


@pytest.mark.parametrize(
    "body", [{"budget_mib": 32}, {"budget_mib": 2048}, {"reserve": "everything"}, {"slots": 8}, [256]]
)
def test_memory_run_rejects_bad_bodies_with_an_openai_error(demo_server: DemoServer, body: object) -> None:
    response = httpx.post(f"{demo_server.url}/v1/demo/memory/run", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_memory_run_progress_names_the_allocator(
    demo_server: DemoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inflight.server import demo

    halfway, finish = threading.Event(), threading.Event()

    def held_run(engine: object, budget_mib: int, reserve: str, tracker: LiveProgress) -> MemoryComparison:
        tracker.requests_total, tracker.allocator, tracker.requests_done = 30, "paged", 5
        halfway.set()
        assert finish.wait(60), "the test never let the run finish"
        return simulate_memory(budget_mib, "max_model_len", DEFAULT_COST_MODEL)

    monkeypatch.setattr(demo, "run_live_memory", held_run)
    run = threading.Thread(
        target=lambda: httpx.post(
            f"{demo_server.url}/v1/demo/memory/run", json={"budget_mib": 64}, timeout=60
        )
    )
    run.start()
    try:
        assert halfway.wait(60), "the run never started"
        progress = httpx.get(f"{demo_server.url}/v1/demo/run/progress").json()
        # One live run at a time, of either kind.
        assert httpx.post(f"{demo_server.url}/v1/demo/run", json={"slots": 2}).status_code == 429
    finally:
        finish.set()
        run.join(60)
    assert progress["running"] and progress["allocator"] == "paged" and progress["policy"] is None
    assert progress["requests_done"] == 5 and progress["requests_total"] == 30
