"""`inflight serve --tensor-parallel-size 2` in a subprocess (real ranks over gloo): started with the
operator's arguments it becomes Ready and drains on SIGTERM; a worker killed mid-generation fails the
in-flight request with an error and the server exits non-zero; no process is left behind either way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from inflight.operator.api.types import ModelServer
from inflight.operator.children import server as builders
from inflight.operator.placement import place

from support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
H100_NODE = {"nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
# Bounds for waiting on the server (a loaded 2-core machine is slow, but never this slow).
START_TIMEOUT_S = 120
EXIT_TIMEOUT_S = 60


def operator_args(model_dir: Path, port: int) -> list[str]:
    """The 70B-on-4-H100 example's server flags as the operator builds them, pointed at the tiny model
    on this CPU: 2 ranks instead of 4, float32, a small pool."""
    (doc,) = [
        d
        for d in yaml.safe_load_all((REPO / "manifests" / "llama-3.1-70b-h100.yaml").read_text())
        if d["kind"] == "ModelServer"
    ]
    doc["metadata"]["uid"] = "u"
    ms = ModelServer.model_validate(doc)
    args = builders.server_args(ms, place(ms.spec, [H100_NODE]))
    overrides = {
        "--model": str(model_dir),
        "--host": "127.0.0.1",
        "--port": str(port),
        "--dtype": "float32",
        "--max-slots": "4",
        "--num-kv-blocks": "64",
        "--max-model-len": "1024",
        "--max-num-batched-tokens": "256",
        "--tensor-parallel-size": "2",
        "--served-model-name": "m",
    }
    assert set(overrides) <= set(args)
    return [overrides.get(args[i - 1], a) if i > 0 else a for i, a in enumerate(args)]


class Server:
    def __init__(self, args: list[str], port: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "inflight.cli", "serve", *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.url = f"http://127.0.0.1:{port}"
        self.ranks: list[psutil.Process] = []

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    self.ranks = psutil.Process(self.process.pid).children(recursive=True)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("inflight serve did not become ready")

    def output(self) -> str:
        return self.process.stdout.read() if self.process.stdout else ""

    def wait_exit(self) -> int:
        code = self.process.wait(EXIT_TIMEOUT_S)
        _, alive = psutil.wait_procs(self.ranks, timeout=EXIT_TIMEOUT_S)
        assert alive == [], f"ranks left behind: {alive}"
        return code

    def kill(self) -> None:
        for proc in [*self.ranks]:
            if proc.is_running():
                proc.kill()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def start_server() -> Iterator[object]:
    servers: list[Server] = []

    def start(args: list[str], port: int) -> Server:
        server = Server(args, port)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.kill()


def stream_body(max_tokens: int) -> dict[str, object]:
    return {"model": "m", "prompt": "def f():", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def test_operator_args_at_two_ranks_become_ready_and_sigterm_drains(
    tiny_llama_dir: Path, start_server: object
) -> None:
    port = free_port()
    server: Server = start_server(operator_args(tiny_llama_dir, port), port)  # type: ignore[operator]
    assert len(server.ranks) == 1  # rank 1; rank 0 is the server process
    ready = httpx.get(f"{server.url}/ready").json()
    assert ready["status"] == "ready"
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=stream_body(40)) as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.wait_exit() == 0


def test_killed_rank_fails_requests_and_the_server_exits_nonzero(
    tiny_llama_dir: Path, start_server: object
) -> None:
    port = free_port()
    args = ["--model", str(tiny_llama_dir), "--port", str(port), "--served-model-name", "m",
            "--num-kv-blocks", "64", "--max-model-len", "1024", "--tensor-parallel-size", "2"]  # fmt: skip
    server: Server = start_server(args, port)  # type: ignore[operator]
    (worker,) = server.ranks
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=stream_body(900)) as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        worker.kill()
        rest = [line for line in lines if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in rest if line != "data: [DONE]"]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and "tensor parallelism stopped" in errors[0]["message"], events[-3:]
    assert server.wait_exit() != 0
    assert "rank 1" in server.output()


async def test_rank_dying_while_idle_fails_the_engine_and_health(tiny_llama_dir: Path) -> None:
    """No request in flight: the watcher notices the dead rank, the engine fails (the server's on_fatal
    shuts it down), /health answers 503 naming the rank, and the other processes are gone."""
    from inflight.engine.async_engine import AsyncEngine
    from inflight.engine.config import EngineConfig
    from inflight.engine.engine import LLMEngine
    from inflight.server.app import create_app
    from inflight.server.context import ServerSettings

    config = EngineConfig(
        num_kv_blocks=32, max_model_len=256, dtype="float32", device="cpu", tensor_parallel_size=2
    )
    fatal: list[BaseException] = []
    engine = AsyncEngine(
        lambda: LLMEngine(tiny_llama_dir, config), max_slots=2, max_queue=2, on_fatal=fatal.append
    )
    engine.start()
    await engine.wait_ready()
    (worker,) = psutil.Process().children(recursive=True)
    worker.kill()
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while engine.state != "failed":
        assert time.monotonic() < deadline, "the engine did not notice the dead rank"
        await asyncio.sleep(0.05)
    assert fatal and "rank 1" in str(fatal[0])
    app = create_app(engine, ServerSettings(served_model_name="m"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        health = await client.get("/health")
        assert health.status_code == 503 and "rank 1" in health.json()["detail"]
        assert (await client.get("/ready")).status_code == 503
    await engine.stop()
    assert psutil.Process().children(recursive=True) == []


def test_ranks_die_with_a_killed_engine_process(tiny_llama_dir: Path) -> None:
    """SIGKILL of rank 0 (no cleanup code runs): its workers exit too (their pipe closes; PDEATHSIG)."""
    script = (
        "import sys, time, torch\n"
        "from inflight.engine.config import EngineConfig\n"
        "from inflight.engine.engine import LLMEngine\n"
        "torch.set_num_threads(1)\n"
        "config = EngineConfig(num_kv_blocks=16, dtype='float32', device='cpu', tensor_parallel_size=2)\n"
        "engine = LLMEngine(sys.argv[1], config)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        ranks = psutil.Process(process.pid).children(recursive=True)
        assert len(ranks) == 1
        process.kill()
        process.wait()
        _, alive = psutil.wait_procs(ranks, timeout=EXIT_TIMEOUT_S)
        assert alive == []
    finally:
        if process.poll() is None:
            process.kill()
