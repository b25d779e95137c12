"""The open-file limit against --max-connections (#27 item 3): raised toward the hard limit at start, the
connection cap lowered with a WARNING when even the hard limit is too low, and a server under a low
`ulimit -n` keeps answering while idle connections pile up."""

from __future__ import annotations

import logging
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inflight.server import descriptors
from inflight.server.descriptors import RESERVED_DESCRIPTORS, fit_connection_cap

from support.threaded_server import wait_ready

PATIENCE = 60.0


class Limits:
    """A stand-in for the process's RLIMIT_NOFILE: `fixed` makes setrlimit fail as without privileges."""

    def __init__(self, soft: int, hard: int, fixed: bool = False) -> None:
        self.soft, self.hard, self.fixed = soft, hard, fixed

    def get(self, _which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def set(self, _which: int, limits: tuple[int, int]) -> None:
        if self.fixed:
            raise ValueError("not allowed to raise the limit")
        self.soft, self.hard = limits


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> Limits:
    current = Limits(300, 300)
    monkeypatch.setattr(descriptors.resource, "getrlimit", current.get)
    monkeypatch.setattr(descriptors.resource, "setrlimit", current.set)
    return current


def test_the_soft_limit_is_raised_as_far_as_the_connections_need(limits: Limits) -> None:
    limits.soft, limits.hard = 300, 100_000
    assert fit_connection_cap(512) == 512
    assert (limits.soft, limits.hard) == (512 + RESERVED_DESCRIPTORS, 100_000)


def test_below_the_hard_limit_the_cap_is_lowered_with_a_warning(
    limits: Limits, caplog: pytest.LogCaptureFixture
) -> None:
    limits.soft, limits.hard = 256, 300
    with caplog.at_level(logging.WARNING, logger="inflight.server"):
        assert fit_connection_cap(512) == 300 - RESERVED_DESCRIPTORS
    assert limits.soft == 300  # raised to the hard limit first
    assert f"serving at most {300 - RESERVED_DESCRIPTORS} connections" in caplog.text
    assert "ulimit -n 576" in caplog.text


def test_a_limit_that_cannot_be_raised_lowers_the_cap(
    limits: Limits, caplog: pytest.LogCaptureFixture
) -> None:
    limits.soft, limits.hard, limits.fixed = 300, 100_000, True
    with caplog.at_level(logging.WARNING, logger="inflight.server"):
        assert fit_connection_cap(512) == 300 - RESERVED_DESCRIPTORS
    assert "cannot raise the open-file limit from 300 to 576" in caplog.text


def test_a_high_enough_limit_is_left_alone(limits: Limits) -> None:
    limits.soft, limits.hard = 4096, 4096
    assert fit_connection_cap(512) == 512
    assert limits.soft == 4096


def test_under_ulimit_n_300_the_server_keeps_answering_while_idle_connections_pile_up(
    tiny_llama_dir: Path,
) -> None:
    """`ulimit -n 300` (soft and hard) and the default cap of 512: before, the process ran out of
    descriptors, new connections waited unaccepted and nothing was logged."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "inflight.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
        "--max-slots", "2", "--num-kv-blocks", "16", "--max-model-len", "128", "--header-timeout", "600",
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300)),
    )
    url = f"http://127.0.0.1:{port}"
    idle: list[socket.socket] = []
    try:
        assert wait_ready(url, PATIENCE * 2, failed=lambda: process.poll() is not None), (
            "the server did not start"
        )
        idle = [socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) for _ in range(300)]
        assert httpx.get(f"{url}/health", timeout=PATIENCE).status_code == 200
    finally:
        for sock in idle:
            sock.close()
        process.terminate()
        output, _ = process.communicate(timeout=PATIENCE)
    assert f"serving at most {300 - RESERVED_DESCRIPTORS} connections" in output, output[-3000:]
