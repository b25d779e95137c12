"""`inflight demo` with its default model (builtin:smollm2, a real chat model) in headless Chromium: the
page's "Ask the loaded model" box gets a real answer. The model comes from the repo's .cache (the
`smollm2_gguf` fixture makes it once), so the server finds it built."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, REPO_ROOT, running_demo

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install -y chromium)"),
]


def test_the_demo_page_shows_a_real_answer(smollm2_gguf: Path, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    assert smollm2_gguf.is_relative_to(REPO_ROOT / ".cache")
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    # No --model: the demo's default. Few slots and KV blocks keep the server small.
    args = ["--max-slots", "2", "--num-kv-blocks", "64"]
    with running_demo(args, REPO_ROOT / ".cache", tmp_path / "server.log") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{url}/demo")
            assert page.input_value("#question") == "What is the capital of France?"
            is_chat = lambda r: r.url.endswith("/v1/chat/completions")  # noqa: E731
            with page.expect_response(is_chat, timeout=120_000) as chat:
                page.click("#ask")
            assert chat.value.status == 200
            page.wait_for_function("document.querySelector('#answer').textContent.length > 0")
            answer = page.text_content("#answer") or ""
            assert "Paris" in answer
            assert answer == chat.value.json()["choices"][0]["message"]["content"]
            page.screenshot(path=str(ARTIFACTS / "demo-page-smollm2-answer.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
