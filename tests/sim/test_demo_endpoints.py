"""GET /demo, GET /v1/demo/simulate and POST /v1/demo/run on a live server (real sockets)."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from inflight.sim.comparison import DemoComparison
from inflight.sim.cost_model import DEFAULT_COST_MODEL, CostModel
from inflight.sim.live import LiveProgress
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
    assert one["static"]["requests"] == one["continuous"]["requests"]
    assert one["throughput_ratio"] == pytest.approx(1.0)
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
    assert 'id="slots"' in page and 'id="run"' in page
    assert "/v1/demo/simulate" in page and "/v1/demo/run" in page
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
        "running": False, "policy": None, "requests_done": 0, "requests_total": 0, "output_tokens": 0,
        "tokens_per_s": 0.0,
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
        "running": True, "policy": "static", "requests_done": 12, "requests_total": 30, "output_tokens": 600,
        "tokens_per_s": 300.0,
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
        response = httpx.post(f"{demo_server.url}/v1/demo/run", json={"slots": 2})
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
