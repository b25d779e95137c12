"""Run the app under uvicorn with a graceful drain on SIGTERM/SIGINT, and resolve `--model`.

On the first SIGTERM (or Ctrl-C): /ready turns 503 and every new API request gets 503 while in-flight
requests finish, up to the drain timeout; whatever is left is then cut short, uvicorn closes its
connections and the process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from pathlib import Path
from types import FrameType

import uvicorn

from inflight.builtin_models import BUILTIN_PREFIX, BuiltinModelError, builtin_model_path
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.gguf import is_gguf

logger = logging.getLogger("inflight.server")


def resolve_model(model: str) -> Path:
    """The checkpoint for `--model`: a folder, a .gguf file, or `builtin:NAME` (made once into the cache
    dir, see inflight/builtin_models.py)."""
    if model.startswith(BUILTIN_PREFIX):
        try:
            return builtin_model_path(model)
        except BuiltinModelError as e:
            raise SystemExit(f"inflight: --model {model}: {e}") from e
    path = Path(model).expanduser()
    if is_gguf(path):
        return path
    if not path.is_dir():
        raise SystemExit(
            f"--model {model}: no such directory or .gguf file (or use builtin:smollm2 / builtin:tiny)"
        )
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there; expected a Hugging Face checkpoint")
    return path


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
        raise SystemExit(
            f"inflight serve: cannot listen on {host}:{port}: {error.strerror}; {hint}"
        ) from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's handler, do not re-raise the signal after shutdown: a drained exit is exit 0.
        if self._loop is None or self._drain_task is not None or not self.started:
            self.force_exit = self._drain_task is not None
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain, signal.Signals(sig).name)

    def _begin_drain(self, name: str) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(name))

    async def _drain(self, name: str) -> None:
        in_flight = self.engine.num_in_flight
        logger.info(
            "%s: draining (%d requests in flight, up to %gs); new requests get 503",
            name,
            in_flight,
            self.drain_timeout,
        )
        cut = await self.engine.drain(self.drain_timeout)
        if cut:
            logger.warning("drain timeout: cut %d unfinished request(s) short", cut)
        else:
            logger.info("drained; shutting down")
        self.should_exit = True

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
