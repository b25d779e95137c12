"""An ASGI app on a real socket, served by uvicorn in a daemon thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn


def serve_in_thread(app: Any, **config: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    """(url, server, thread) of `app` on a free 127.0.0.1 port; `config` goes to uvicorn.Config.

    Stop it with `server.should_exit = True` and `thread.join()`."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options: dict[str, Any] = {"log_config": None, "access_log": False, "timeout_graceful_shutdown": 2}
    server = uvicorn.Server(uvicorn.Config(app, **{**options, **config}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}", server, thread


def wait_ready(url: str, timeout: float, failed: Callable[[], bool] = lambda: False) -> bool:
    """Poll `url`/ready until it answers 200 (True), `failed()` says it never will, or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if failed():
            return False
        time.sleep(0.05)
    return False
