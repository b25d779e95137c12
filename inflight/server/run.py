"""`serve()`: one model behind the OpenAI app under uvicorn, with a graceful drain on SIGTERM/SIGINT.

`inflight serve` and `inflight demo` both start their server through `serve()`.

On the first SIGTERM (or Ctrl-C): /ready turns 503 and every new API request gets 503 while in-flight
requests finish, up to the drain timeout; whatever is left is then cut short, uvicorn closes its
connections and the process exits 0. A second signal ends the wait at once: every open request is cut
short the same way (a stream gets its error event and `[DONE]`, a JSON request a 503), and the process
exits 128 + the signal's number (143 for SIGTERM). A third signal stops without waiting for anything.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import FrameType

import uvicorn

from inflight.engine.async_engine import AsyncEngine
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.server.app import create_app, model_loaded
from inflight.server.context import ServerSettings
from inflight.server.descriptors import fit_connection_cap
from inflight.server.limits import DEFAULT_MAX_QUEUE, ConnectionLimits
from inflight.server.transport import guarded_protocol

logger = logging.getLogger("inflight.server")


def serve(
    model_dir: Path,
    config: EngineConfig,
    settings: ServerSettings,
    sock: socket.socket,
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    limits: ConnectionLimits | None = None,
    drain_timeout: float,
    app_state: Mapping[str, object] | None = None,
) -> int:
    """Serve `model_dir` on `sock` (from `bind_socket`) until a signal has drained it or the engine
    failed; the process's exit code (1 if the engine failed). The model loads with the app's lifespan,
    so probes answer while it loads. `app_state` goes onto `app.state` (the demo's step cost model)."""
    engine = AsyncEngine(
        lambda: LLMEngine(model_dir, config), max_slots=config.max_num_seqs, max_queue=max_queue
    )
    app = create_app(engine, settings)
    for name, value in (app_state or {}).items():
        setattr(app.state, name, value)
    uvicorn_config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        http=guarded_protocol(_fitted(limits or ConnectionLimits())),
    )
    server = DrainingServer(uvicorn_config, engine, drain_timeout=drain_timeout)
    engine.on_fatal = server.stop_on_engine_failure
    server.run(sockets=[sock])
    code = 1 if engine.state == "failed" else server.exit_code
    if not model_loaded(engine):
        # Stopped during the load: its thread is inside the weights reader and cannot be joined or
        # interrupted; a normal interpreter exit would abort under it. Leave now, logs flushed.
        logging.shutdown()
        os._exit(code)
    return code


def _fitted(limits: ConnectionLimits) -> ConnectionLimits:
    """`limits` with the connection cap the process's open-file limit allows (raised first if it can be)."""
    return replace(limits, max_connections=fit_connection_cap(limits.max_connections))


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails at once and clearly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        hint = (
            "another process is listening there; stop it or choose another --port"
            if error.errno == errno.EADDRINUSE
            else "check --host and --port"
        )
        raise SystemExit(f"inflight: cannot listen on {host}:{port}: {error.strerror}; {hint}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain: the first signal drains, a second cuts the drain short (every open
    request ends with its error, then the process exits 128 + the signal's number), a third stops at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.cut_short_by: int | None = None  # the signal that cut the drain short
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._stop_waiting = asyncio.Event()

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's handler, do not re-raise the signal after shutdown: a drained exit is exit 0.
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig))

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(sig.name))
        elif self.cut_short_by is None:
            logger.warning("%s again: cutting the drain short; open requests end with an error", sig.name)
            self.cut_short_by = sig
            self._stop_waiting.set()
        else:
            logger.warning("%s a third time: stopping at once", sig.name)
            self.force_exit = self.should_exit = True

    async def _drain(self, name: str) -> None:
        in_flight = self.engine.num_in_flight
        logger.info(
            "%s: draining (%d requests in flight, up to %gs); new requests get 503",
            name,
            in_flight,
            self.drain_timeout,
        )
        cut = await self.engine.drain(self.drain_timeout, self._stop_waiting)
        if self.cut_short_by is not None:
            logger.warning("drain cut short: ended %d unfinished request(s)", cut)
        elif cut:
            logger.warning("drain timeout: cut %d unfinished request(s) short", cut)
        else:
            logger.info("drained; shutting down")
        self.should_exit = True

    @property
    def exit_code(self) -> int:
        """0 after a drain, 128 + the signal's number when a second signal cut it short."""
        return 0 if self.cut_short_by is None else 128 + self.cut_short_by

    def stop_on_engine_failure(self, error: BaseException) -> None:
        logger.error("the engine failed: %s; shutting down", error)
        self.should_exit = True


def configure_logging(level: str) -> None:
    """Plain lines for the server log, bare JSON lines on `inflight.access`."""
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    access = logging.getLogger("inflight.access")
    access.propagate = False
    access.handlers.clear()
    access_handler = logging.StreamHandler()
    access_handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(access_handler)
    access.setLevel(level.upper())
