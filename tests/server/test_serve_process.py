"""`inflight serve` startup failures: a bad --port, a taken port, SIGTERM while the model loads.

Each must end the process promptly with a message that says what is wrong (a subprocess, real signals).
The model load is held forever by a weights file that is a named pipe nobody writes: deterministic,
however fast the machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inflight.cli import build_parser

PATIENCE = 60.0


def serve_command(model: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "inflight.cli", "serve", "--model", str(model), "--port", str(port),
            "--max-slots", "2", "--num-kv-blocks", "16", "--max-model-len", "128"]  # fmt: skip


def start(model: Path, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        serve_command(model, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_a_port_out_of_range_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # parsing only: a port that passes must not start a server
        build_parser().parse_args(["serve", "--model", "builtin:tiny", "--port", port])
    assert exit_info.value.code == 2
    assert "is not a port number (1..65535)" in capsys.readouterr().err


def test_a_taken_port_fails_at_once_with_a_clear_message(tiny_llama_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        process = start(tiny_llama_dir, taken.getsockname()[1])
        try:
            output, _ = process.communicate(timeout=PATIENCE)
        finally:
            process.kill()
    assert process.returncode == 1
    assert "cannot listen on 127.0.0.1:" in output and "another process is listening there" in output
    assert "Traceback" not in output


def test_sigterm_while_the_model_loads_exits_at_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_llama_dir.iterdir():
        if item.suffix != ".safetensors":
            (model / item.name).symlink_to(item)
    os.mkfifo(model / "model.safetensors")  # opening it for reading blocks until a writer comes: never
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = start(model, port)
    try:
        deadline = time.monotonic() + PATIENCE
        while True:  # the port opens at once; the model is loading
            assert process.poll() is None and time.monotonic() < deadline
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=PATIENCE)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert "still loading; not waiting for the load" in output
