"""`inflight serve` in a subprocess: SIGTERM drains (in-flight stream completes, new requests 503, exit 0)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from support.processes import free_port

HELD_CLI = Path(__file__).parents[1] / "support" / "held_cli.py"


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll `check` until it is true; fail naming `what` after `timeout` seconds (a hang guard only)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def hold(tmp_path: Path) -> Path:
    """While this file exists the served engine runs no step (held_cli.py); `<hold>.held` says it waits."""
    return tmp_path / "hold"


@pytest.fixture
def serve(tiny_llama_dir: Path, hold: Path) -> Iterator[object]:
    processes: list[subprocess.Popen[str]] = []

    def start(*extra: str) -> tuple[subprocess.Popen[str], str]:
        port = free_port()
        command = [
            sys.executable, str(HELD_CLI), str(hold), "serve", "--model", str(tiny_llama_dir),
            "--served-model-name", "tiny", "--port", str(port), "--max-slots", "2",
            "--num-kv-blocks", "64", "--max-model-len", "1024", *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        processes.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    return process, url
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("inflight serve did not become ready")

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def held(hold: Path) -> bool:
    return hold.with_name(hold.name + ".held").exists()


def test_sigterm_finishes_in_flight_streams_refuses_new_requests_and_exits_0(
    serve: object, hold: Path
) -> None:
    process, url = serve("--drain-timeout", "60")  # type: ignore[operator]
    body = {"model": "tiny", "prompt": "def f():", "max_tokens": 200, "ignore_eos": True, "stream": True}
    hold.touch()  # the stream stays in flight until the test removes the file
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        wait_until(lambda: held(hold), "the request to reach the engine")
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{url}/ready").status_code != 200, "SIGTERM to start a drain")
        refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        assert httpx.get(f"{url}/health").status_code == 200
        hold.unlink()
        events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert process.wait(timeout=60) == 0
    log = process.stdout.read() if process.stdout else ""
    assert "SIGTERM: draining" in log
    assert '"path": "/v1/completions", "status": 503' in log


def test_the_drain_timeout_cuts_what_is_left_and_still_exits_0(serve: object, hold: Path) -> None:
    process, url = serve("--drain-timeout", "0.5")  # type: ignore[operator]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    hold.touch()  # the request cannot finish before the drain timeout cuts it
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        wait_until(lambda: held(hold), "the request to reach the engine")
        process.send_signal(signal.SIGTERM)
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if '"error"' in line:
                    hold.unlink()  # cut short: let the engine thread finish its step and stop
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert process.wait(timeout=60) == 0
    assert "drain timeout: cut 1 unfinished request(s) short" in (
        process.stdout.read() if process.stdout else ""
    )


def test_a_second_sigterm_ends_every_stream_with_its_error_and_exits_143(serve: object, hold: Path) -> None:
    """The drain would wait a minute; a second SIGTERM ends it now: both open streams get the error event
    and [DONE], the access log counts them as served (not as clients that left), no traceback, exit 143."""
    process, url = serve("--drain-timeout", "60")  # type: ignore[operator]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    hold.touch()  # neither stream can finish before the second signal
    events: list[list[str]] = [[], []]
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as open_streams:
        responses = [
            open_streams.enter_context(client.stream("POST", f"{url}/v1/completions", json=body))
            for _ in range(2)
        ]
        wait_until(lambda: held(hold), "the requests to reach the engine")
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{url}/ready").status_code != 200, "SIGTERM to start a drain")
        process.send_signal(signal.SIGTERM)
        for response, received in zip(responses, events, strict=True):
            received += [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
        hold.unlink()  # cut short: let the engine thread finish its step and stop
    for received in events:
        assert received[-1] == "[DONE]"
        assert json.loads(received[-2])["error"]["code"] == "shutting_down"
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    log = process.stdout.read() if process.stdout else ""
    assert "SIGTERM again: cutting the drain short" in log
    assert "drain cut short: ended 2 unfinished request(s)" in log
    assert "Traceback" not in log and "CancelledError" not in log
    access = [json.loads(line) for line in log.splitlines() if line.startswith('{"method": "POST"')]
    assert [(a["path"], a["status"]) for a in access] == [("/v1/completions", 200)] * 2
    assert not any(a.get("disconnected") for a in access), access
