"""Real `inflight serve` processes of the tiny model and an in-thread router, for the router tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from inflight.router.app import Discovery, Router, RouterApp, RouterSettings

from support.processes import free_port, stop_processes
from support.threaded_server import serve_in_thread, wait_ready

MODEL = "tiny"
# Per replica: room for what a third of the affinity workload keeps, not for all of it (a real pool is
# finite, and round robin makes every replica cache every conversation).
KV_BLOCKS = 384


@dataclass
class ServerProcess:
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """A sample's value from the server's /metrics (summed over labels)."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rpartition(" ")[2])
        return total


def start_servers(model_dir: Path, count: int, logs: Path, *extra: str) -> list[ServerProcess]:
    """`count` real servers of the tiny model (one thread each), started at once, ready when returned."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    servers = []
    for _ in range(count):
        port = free_port()
        command = [sys.executable, "-m", "inflight.cli", "serve", "--model", str(model_dir)]
        command += ["--served-model-name", MODEL, "--port", str(port), "--max-model-len", "1024", *extra]
        log = logs / f"server-{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        servers.append(ServerProcess(port, process, log))
    deadline = time.monotonic() + 180
    for server in servers:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"server exited:\n{server.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in time:\n{server.log.read_text()[-3000:]}")
            time.sleep(0.2)
    return servers


def stop_servers(servers: list[ServerProcess]) -> None:
    stop_processes(server.process for server in servers)


@dataclass
class LiveRouter:
    url: str
    router: Router
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metric(self, name: str, labels: str = "") -> float:
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == wanted:
                return float(value)
        return 0.0


def start_router(discovery: Discovery, settings: RouterSettings | None = None) -> LiveRouter:
    """The router app on a real socket, in a thread with its own event loop."""
    router = Router(settings or RouterSettings(scrape_interval_s=0.5))
    app = RouterApp(router, discovery)
    url, server, thread = serve_in_thread(app)
    live = LiveRouter(url, router, server, thread)
    if wait_ready(url, timeout=30):
        return live
    live.stop()
    raise RuntimeError("the router did not become ready")
