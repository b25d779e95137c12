"""A live demo server for the endpoint tests: real uvicorn on 127.0.0.1 (free port), the tiny model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from inflight.engine.async_engine import AsyncEngine
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.server.app import create_app
from inflight.server.context import ServerSettings

from support.demo_server import DemoServer
from support.torch_threads import one_torch_thread

__all__ = ["one_torch_thread"]


@pytest.fixture(scope="session")
def demo_server(tiny_llama_dir: Path) -> Iterator[DemoServer]:
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256)
    engine = AsyncEngine(lambda: LLMEngine(tiny_llama_dir, config), max_slots=4, max_queue=8)
    app = create_app(engine, ServerSettings(served_model_name="tiny"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = DemoServer(f"http://127.0.0.1:{sock.getsockname()[1]}", app, server, thread)
    deadline = time.monotonic() + 120
    while not _ready(live.url):
        if engine.state == "failed" or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"demo test server did not become ready: {engine.state} {engine.error}")
        time.sleep(0.1)
    yield live
    server.should_exit = True
    thread.join(30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
