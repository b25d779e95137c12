"""Live servers for the server tests: real uvicorn on 127.0.0.1 (free port), the tiny model, real sockets."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from inflight.engine.async_engine import AsyncEngine
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.server.app import create_app
from inflight.server.context import ServerSettings
from inflight.server.limits import DEFAULT_MAX_BODY_BYTES, ConnectionLimits
from inflight.server.tool_parsers import ParserChoice
from inflight.server.transport import guarded_protocol

from support.threaded_server import serve_in_thread, wait_ready
from support.torch_threads import one_torch_thread

__all__ = ["one_torch_thread"]

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
    max_model_len: int = MAX_MODEL_LEN,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    connection_limits: ConnectionLimits | None = None,
    engine_max_slots: int | None = None,
    served_model_name: str = MODEL_NAME,
    tool_call_parser: ParserChoice = "auto",
) -> LiveServer:
    """`engine_max_slots`: give the engine fewer slots than the server admits (to make it fail requests)."""
    config = EngineConfig(
        max_num_seqs=engine_max_slots or max_slots,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=512,
    )
    engine = AsyncEngine(lambda: LLMEngine(model_dir, config), max_slots=max_slots, max_queue=max_queue)
    settings = ServerSettings(
        served_model_name=served_model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        tool_call_parser=tool_call_parser,
    )
    app = create_app(engine, settings)
    url, server, thread = serve_in_thread(app, http=guarded_protocol(connection_limits or ConnectionLimits()))
    live = LiveServer(url, app, engine, server, thread)
    if wait_ready(url, timeout=180, failed=lambda: engine.state == "failed"):
        return live
    live.stop()
    raise RuntimeError(f"test server did not become ready (engine state {engine.state}: {engine.error})")


class StepGate:
    """Holds a live server's engine thread at the start of each step until the test lets steps through.

    Tests use it to put a request in a known state (in the engine, not finished) whatever the machine's
    speed, instead of hoping it is still running after some time.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._permits: int | None = 0  # steps allowed through; None: open
        self._waiting = 0  # engine threads blocked at the gate (0 or 1)

    def pass_through(self) -> None:
        """Called by the engine thread before each step: block until a permit (or the gate opens)."""
        with self._condition:
            self._waiting += 1
            self._condition.notify_all()
            while self._permits == 0:
                self._condition.wait()
            self._waiting -= 1
            if self._permits is not None:
                self._permits -= 1
            self._condition.notify_all()

    def allow(self, steps: int = 1) -> None:
        with self._condition:
            self._permits = (self._permits or 0) + steps
            self._condition.notify_all()

    def open(self) -> None:
        with self._condition:
            self._permits = None
            self._condition.notify_all()

    def wait_until_held(self, timeout: float = 60) -> None:
        """Wait until the engine thread is blocked at the gate with no permit left (it has work to do)."""
        with self._condition:
            held = self._condition.wait_for(lambda: self._waiting > 0 and self._permits == 0, timeout)
        assert held, f"the engine did not reach the step gate within {timeout} s"


@pytest.fixture
def step_gate() -> Iterator[Callable[[LiveServer], StepGate]]:
    """`step_gate(server)` puts a closed `StepGate` in front of that server's engine steps (removed after)."""
    installed: list[tuple[LLMEngine, StepGate]] = []

    def install(server: LiveServer) -> StepGate:
        engine, gate = server.engine.engine, StepGate()
        original = engine.step

        def gated_step() -> Any:
            gate.pass_through()
            return original()

        engine.step = gated_step  # type: ignore[method-assign]
        installed.append((engine, gate))
        return gate

    yield install
    for engine, gate in installed:
        gate.open()
        del engine.step  # back to the class's method


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll `check` until it is true; fail naming `what` after `timeout` seconds (a hang guard only)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="session")
def wait_for() -> Callable[..., None]:
    """`wait_until` for test modules (they cannot import the conftest)."""
    return wait_until


@pytest.fixture(scope="session")
def start_server_factory() -> Callable[..., LiveServer]:
    """`start_server` for modules that need a server configured their own way (stop it yourself)."""
    return start_server


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """The shared server: no API key, 8 slots, 128 KV blocks of 16 tokens, max_model_len 256."""
    server = start_server(tiny_llama_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def roomy_live(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """A server with room for long prompts (tool listings): max_model_len 1024, 512 KV blocks."""
    server = start_server(tiny_llama_dir, max_model_len=1024, num_kv_blocks=512)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def offline_engine(tiny_llama_dir: Path) -> LLMEngine:
    """The same model in an offline engine, for 'served equals offline' checks."""
    return LLMEngine(
        tiny_llama_dir, EngineConfig(max_num_seqs=8, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN)
    )
