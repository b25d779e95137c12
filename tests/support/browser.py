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

import httpx
import pytest

from support.processes import free_port

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
