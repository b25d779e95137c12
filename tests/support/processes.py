"""Ports and child processes of tests that start real servers."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_processes(processes: Iterable[subprocess.Popen[bytes]], timeout: float = 10) -> None:
    """SIGTERM every process still running, then wait for each; one that outlives `timeout` is killed."""
    started = list(processes)
    for process in started:
        if process.poll() is None:
            process.terminate()
    for process in started:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
