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

from support.browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, running_demo

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
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(f"{demo_url}/demo")
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
        finally:
            browser.close()
    assert errors == []
