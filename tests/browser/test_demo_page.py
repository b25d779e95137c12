"""The demo page in headless Chromium against `inflight demo` (real uvicorn on 127.0.0.1, tiny model).

Loads /demo, moves the slider, checks that the page's figures change and equal the JSON endpoint's,
runs the workload for real with the button and checks the measured figures, and saves screenshots
under test-artifacts/. Skipped only where no Chromium is installed (`apt-get install chromium`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.browser import ARTIFACTS, CHROMIUM, demo_page, running_demo

POLICIES = ("static", "continuous")
FIGURES = ("throughput_tokens_per_s", "makespan_s", "mean_latency_s", "p95_latency_s", "idle_slot_s", "steps")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install -y chromium)"),
]


@pytest.fixture(scope="module")
def demo_url(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # No saved calibration: the built-in cost model, as the JSON checks below expect.
    cache = tmp_path_factory.mktemp("cache")
    args = ["--model", str(tiny_llama_dir), "--max-slots", "4", "--num-kv-blocks", "64"]
    with running_demo(args, cache, tmp_path_factory.mktemp("demo") / "server.log") as url:
        yield url


def _page_figures(page: Any, attribute: str) -> dict[str, float]:
    return {
        f"{policy}.{key}": float(page.get_attribute(f"[{attribute}='{policy}.{key}']", "data-value"))
        for policy in POLICIES
        for key in FIGURES
    }


def _json_figures(body: dict[str, Any]) -> dict[str, float]:
    return {f"{policy}.{key}": float(body[policy][key]) for policy in POLICIES for key in FIGURES}


def test_demo_page_slider_and_real_run(demo_url: str) -> None:
    with demo_page(demo_url) as page:
        page.wait_for_selector("body[data-slots='8']")
        at_8 = _page_figures(page, "data-figure")
        body_8 = httpx.get(f"{demo_url}/v1/demo/simulate?slots=8").json()
        assert at_8 == pytest.approx(_json_figures(body_8))
        assert page.text_content("#ratio") == f"{body_8['throughput_ratio']:.2f}×"
        assert page.text_content("#summary") == body_8["summary"]
        assert body_8["throughput_ratio"] >= 2.0
        # One bar per request in each chart; slots lanes.
        assert page.locator("#chart-static g.bar").count() == 30
        page.screenshot(path=str(ARTIFACTS / "demo-page-8-slots.png"), full_page=True)

        for slots in ("3", "16"):
            page.locator("#slots").fill(slots)
            page.wait_for_selector(f"body[data-slots='{slots}']")
            assert page.text_content("#slots-value") == slots
            figures = _page_figures(page, "data-figure")
            body = httpx.get(f"{demo_url}/v1/demo/simulate?slots={slots}").json()
            assert figures == pytest.approx(_json_figures(body))
            assert figures != at_8
            assert page.text_content("#ratio") == f"{body['throughput_ratio']:.2f}×"

        # While the run is pending, the status line follows the server's progress (not one fixed line):
        # the run's request is held and the progress answered by the test, so that is seen however
        # fast the machine runs the workload.
        held: list[Any] = []
        page.route("**/v1/demo/run", lambda route: held.append(route))
        progress = {"running": True, "policy": "continuous", "requests_done": 7, "requests_total": 30,
                    "output_tokens": 900, "tokens_per_s": 450.0}  # fmt: skip
        page.route("**/v1/demo/run/progress", lambda route: route.fulfill(json=progress))
        page.click("#run")
        page.wait_for_selector("#run-status[data-progress]", timeout=60_000)
        status = page.text_content("#run-status") or ""
        assert "continuous batching (2 of 2): 7/30 requests done, 450 output tokens/s so far" in status
        page.unroute("**/v1/demo/run/progress")
        with page.expect_response(lambda r: r.url.endswith("/v1/demo/run"), timeout=240_000) as run:
            held[0].continue_()
        assert run.value.status == 200
        measured_body = run.value.json()
        page.wait_for_selector("#measured-summary[data-ratio]")
        measured = _page_figures(page, "data-measured")
        assert measured == pytest.approx(_json_figures(measured_body))
        assert measured_body["kind"] == "measured" and measured_body["slots"] == 16
        for policy in POLICIES:
            # Same decisions as the simulation; only the clock differs.
            assert measured[f"{policy}.steps"] == figures[f"{policy}.steps"]
            assert measured[f"{policy}.throughput_tokens_per_s"] > 0
        assert page.is_visible("#measured-static-head")
        summary = page.text_content("#measured-summary") or ""
        assert f"{measured_body['throughput_ratio']:.2f}×" in summary
        # The headline and the charts show the measured run; the toggle switches back to the simulated.
        assert (page.text_content("#static-caption") or "").startswith("measured:")
        assert page.text_content("#ratio") == f"{measured_body['throughput_ratio']:.2f}×"
        assert page.text_content("#summary") == measured_body["summary"]
        page.screenshot(path=str(ARTIFACTS / "demo-page-measured.png"), full_page=True)
        page.check("input[name=view][value=simulated]")
        assert (page.text_content("#static-caption") or "").startswith("simulated:")
        assert page.text_content("#ratio") == f"{body['throughput_ratio']:.2f}×"
        page.locator("#slots").fill("8")
        page.wait_for_selector("body[data-slots='8']")
        assert page.is_disabled("#view-measured")


ALLOCATORS = ("contiguous", "paged")
MEMORY_FIGURES = ("mean_in_flight", "peak_in_flight", "waste_share", "throughput_tokens_per_s", "makespan_s")


def _memory_figures(page: Any) -> dict[str, float]:
    return {
        f"{allocator}.{key}": float(
            page.get_attribute(f"[data-mem-figure='{allocator}.{key}']", "data-value")
        )
        for allocator in ALLOCATORS
        for key in MEMORY_FIGURES
    }


def _memory_json(demo_url: str, budget: str, reserve: str) -> dict[str, Any]:
    response = httpx.get(f"{demo_url}/v1/demo/memory", params={"budget_mib": budget, "reserve": reserve})
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


def test_memory_panel_slider_and_reservation(demo_url: str) -> None:
    with demo_page(demo_url) as page:
        page.wait_for_selector("body[data-budget='256:max_model_len']")
        default = _memory_figures(page)
        body = _memory_json(demo_url, "256", "max_model_len")
        assert default == pytest.approx(
            {f"{a}.{key}": float(body[a][key]) for a in ALLOCATORS for key in MEMORY_FIGURES}
        )
        # At the default budget, paged blocks hold at least twice the requests in flight.
        assert default["paged.mean_in_flight"] >= 2 * default["contiguous.mean_in_flight"]
        assert page.text_content("#mem-ratio") == f"{body['in_flight_ratio']:.1f}×"
        assert page.text_content("#mem-summary") == body["summary"]
        assert page.locator("#chart-inflight path[data-allocator]").count() == 4
        page.locator("#memory").scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "demo-page-memory.png"), full_page=True)

        seen = [default]
        for budget in ("128", "640"):
            page.locator("#budget").fill(budget)
            page.wait_for_selector(f"body[data-budget='{budget}:max_model_len']")
            assert page.text_content("#budget-value") == f"{budget} MiB"
            figures = _memory_figures(page)
            for allocator in ALLOCATORS:  # the slider moves both allocators' results
                assert all(
                    figures[f"{allocator}.makespan_s"] != earlier[f"{allocator}.makespan_s"]
                    for earlier in seen
                )
            seen.append(figures)

        page.check("input[name=reserve][value=prompt_plus_max_tokens]")
        page.wait_for_selector("body[data-budget='640:prompt_plus_max_tokens']")
        exact = _memory_figures(page)
        body = _memory_json(demo_url, "640", "prompt_plus_max_tokens")
        assert exact["contiguous.waste_share"] == pytest.approx(body["contiguous"]["waste_share"])
        assert exact["contiguous.waste_share"] < seen[-1]["contiguous.waste_share"]
        assert exact["paged.makespan_s"] == seen[-1]["paged.makespan_s"]


def test_memory_panel_runs_both_allocators_for_real(demo_url: str) -> None:
    with demo_page(demo_url) as page:
        page.wait_for_selector("body[data-budget='256:max_model_len']")
        simulated = _memory_figures(page)
        assert page.is_disabled("#mem-view-measured")
        # While the run is pending, the status line follows the server's progress (the run's request is
        # held and the progress answered by the test, so that is seen however fast the machine is).
        held: list[Any] = []
        page.route("**/v1/demo/memory/run", lambda route: held.append(route))
        progress = {"running": True, "policy": None, "allocator": "paged", "requests_done": 9,
                    "requests_total": 30, "output_tokens": 300, "tokens_per_s": 150.0}  # fmt: skip
        page.route("**/v1/demo/run/progress", lambda route: route.fulfill(json=progress))
        page.click("#mem-run")
        page.wait_for_selector("#mem-run-status[data-progress]", timeout=60_000)
        status = page.text_content("#mem-run-status") or ""
        assert "paged KV (2 of 2): 9/30 requests done, 150 output tokens/s so far" in status
        page.unroute("**/v1/demo/run/progress")
        with page.expect_response(lambda r: r.url.endswith("/v1/demo/memory/run"), timeout=300_000) as run:
            held[0].continue_()
        assert run.value.status == 200
        body = run.value.json()
        page.wait_for_selector("#mem-measured-summary[data-ratio]")
        measured = {
            f"{a}.{key}": float(page.get_attribute(f"[data-mem-measured='{a}.{key}']", "data-value"))
            for a in ALLOCATORS
            for key in MEMORY_FIGURES
        }
        # Figures for both allocators, the response's, next to the simulated ones.
        assert measured == pytest.approx(
            {f"{a}.{key}": float(body[a][key]) for a in ALLOCATORS for key in MEMORY_FIGURES}
        )
        assert body["kind"] == "measured" and body["budget_mib"] == 256
        assert page.is_visible("[data-mem-measured='paged.mean_in_flight']")
        assert _memory_figures(page) == simulated
        # At the default budget, paged holds more requests in flight than contiguous, measured too; the
        # peaks are the simulated ones (the same scheduling decisions).
        assert measured["paged.mean_in_flight"] > measured["contiguous.mean_in_flight"]
        for allocator in ALLOCATORS:
            assert measured[f"{allocator}.peak_in_flight"] == simulated[f"{allocator}.peak_in_flight"]
            assert measured[f"{allocator}.throughput_tokens_per_s"] > 0
        assert f"{body['in_flight_ratio']:.1f}×" in (page.text_content("#mem-measured-summary") or "")
        # The headline and the charts show the measured run; the toggle switches back to the simulated.
        assert page.text_content("#mem-ratio") == f"{body['in_flight_ratio']:.1f}×"
        assert page.text_content("#mem-summary") == body["summary"]
        assert (page.text_content("#mem-paged-caption") or "").startswith("measured:")
        page.locator("#memory").scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "demo-page-memory-measured.png"), full_page=True)
        page.check("input[name=mem-view][value=simulated]")
        assert (page.text_content("#mem-paged-caption") or "").startswith("simulated:")
        page.locator("#budget").fill("128")
        page.wait_for_selector("body[data-budget='128:max_model_len']")
        assert page.is_disabled("#mem-view-measured")


SERVING_POLICIES = ("naive", "static", "continuous")


def _serving_figures(page: Any) -> dict[str, float]:
    return {
        f"{policy}.requests_per_s": float(
            page.get_attribute(f"[data-serving='{policy}.requests_per_s']", "data-value")
        )
        for policy in SERVING_POLICIES
    }


def test_serving_panel_answers_for_the_chosen_gpus(demo_url: str) -> None:
    with demo_page(demo_url) as page:
        page.wait_for_selector("body[data-serving='meta-llama/Llama-3.1-70B:H100-80GB:4']")
        four = _serving_figures(page)
        body = httpx.get(f"{demo_url}/v1/demo/serving").json()
        assert four == pytest.approx(
            {f"{p}.requests_per_s": body["estimate"][p]["requests_per_s"] for p in SERVING_POLICIES}
        )
        assert (
            four["naive.requests_per_s"] < four["static.requests_per_s"] < four["continuous.requests_per_s"]
        )
        assert page.text_content("#serving-replicas") == f"{body['estimate']['replicas']} replicas"
        assert "This is a model" in (page.text_content("main") or "")
        assert page.locator("#serving-constants li").count() == len(body["estimate"]["constants"])
        page.locator("#serving").scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "demo-page-serving.png"), full_page=True)

        page.select_option("#serving-gpus", "8")
        page.wait_for_selector("body[data-serving='meta-llama/Llama-3.1-70B:H100-80GB:8']")
        eight = _serving_figures(page)
        assert eight["continuous.requests_per_s"] > four["continuous.requests_per_s"]

        page.select_option("#serving-gpus", "1")
        page.wait_for_selector("body[data-serving='meta-llama/Llama-3.1-70B:H100-80GB:1']")
        assert page.text_content("#serving-replicas") == "does not fit"
