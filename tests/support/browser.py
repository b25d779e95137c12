"""Headless Chromium and a running `inflight demo` for the browser tests (tests/browser/)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from support.processes import free_port

if TYPE_CHECKING:
    from playwright.sync_api import Page

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def running_demo(args: list[str], cache_dir: Path, log: Path) -> Iterator[str]:
    """`inflight demo ARGS` on a free port with $INFLIGHT_CACHE_DIR=cache_dir; yields its URL once ready,
    and checks it exits 0 on SIGTERM."""
    port = free_port()
    env = {**os.environ, "INFLIGHT_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "inflight.cli", "demo", *args]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`inflight demo` did not become ready; its log:\n{log.read_text()}")
            time.sleep(0.2)
        assert f"open {url}/demo" in log.read_text()
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(30) == 0, log.read_text()
        except subprocess.TimeoutExpired:
            process.kill()
            raise


@contextmanager
def demo_page(url: str) -> Iterator[Page]:
    """`url`/demo open in headless Chromium (1280x900); fails the test if the page raised an error or
    got a 4xx/5xx response."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(f"{url}/demo")
            yield page
        finally:
            browser.close()
    assert errors == []
