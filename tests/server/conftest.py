"""Live servers for the server tests: real uvicorn on 127.0.0.1 (free port), the tiny model, real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from inflight.engine.async_engine import AsyncEngine
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.server.app import ServerSettings, create_app
from inflight.server.limits import DEFAULT_MAX_BODY_BYTES, ConnectionLimits
from inflight.server.transport import guarded_protocol

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256


@dataclass
class LiveServer:
    url: str
    app: FastAPI
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def call_in_loop(self, coroutine: Any, timeout: float = 60) -> Any:
        """Run a coroutine on the server's event loop (e.g. engine.drain) and return its result."""
        loop = self.engine._loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample's value from /metrics (0.0 if absent)."""
        text = httpx.get(f"{self.url}/metrics").text
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if key == wanted:
                return float(value)
        return 0.0


def start_server(
    model_dir: Path,
    *,
    api_key: str | None = None,
    max_slots: int = 8,
    max_queue: int = 64,
    num_kv_blocks: int = 128,
    block_size: int = 16,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    connection_limits: ConnectionLimits | None = None,
    engine_max_slots: int | None = None,
    served_model_name: str = MODEL_NAME,
) -> LiveServer:
    """`engine_max_slots`: give the engine fewer slots than the server admits (to make it fail requests)."""
    config = EngineConfig(
        max_num_seqs=engine_max_slots or max_slots,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512,
    )
    engine = AsyncEngine(lambda: LLMEngine(model_dir, config), max_slots=max_slots, max_queue=max_queue)
    settings = ServerSettings(
        served_model_name=served_model_name, api_key=api_key, max_body_bytes=max_body_bytes
    )
    app = create_app(engine, settings)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=2,
            http=guarded_protocol(connection_limits or ConnectionLimits()),
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app, engine, server, thread)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{live.url}/ready", timeout=5).status_code == 200:
                return live
        except httpx.TransportError:
            pass
        if engine.state == "failed":
            break
        time.sleep(0.1)
    live.stop()
    raise RuntimeError(f"test server did not become ready (engine state {engine.state}: {engine.error})")


@pytest.fixture(scope="session")
def start_server_factory() -> Callable[..., LiveServer]:
    """`start_server` for modules that need a server configured their own way (stop it yourself)."""
    return start_server


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread while these modules run: on a busy 2-core machine, OpenMP threads spinning
    against each other make a tiny model's step ~20x slower. Restored afterwards for other test areas."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """The shared server: no API key, 8 slots, 128 KV blocks of 16 tokens, max_model_len 256."""
    server = start_server(tiny_llama_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def offline_engine(tiny_llama_dir: Path) -> LLMEngine:
    """The same model in an offline engine, for 'served equals offline' checks."""
    return LLMEngine(
        tiny_llama_dir, EngineConfig(max_num_seqs=8, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN)
    )
