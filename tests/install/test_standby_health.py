"""A standby operator replica answers the chart's probes (GET /healthz) while it waits for the Lease.

The chart runs 2 replicas with leader election and probes both; a replica with nothing on the probe port
would be restarted by kubelet, and a rolling update would wait forever for its new pod to become Ready.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest

from inflight.operator import main
from inflight.operator.kube import OPERATOR_USER_AGENT, KubeClient, configuration_for
from inflight.operator.main import OperatorOptions, serve_standby_health

from support.processes import free_port


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        body = await response.json() if response.status == 200 else None
        return response.status, body


async def test_standby_health_answers_the_probe_path_then_frees_the_port() -> None:
    port = free_port()
    runner = await serve_standby_health(f"http://127.0.0.1:{port}/healthz")
    try:
        assert await get(f"http://127.0.0.1:{port}/healthz") == (
            200,
            {"leader": False, "status": "standing by for the Lease"},
        )
        assert (await get(f"http://127.0.0.1:{port}/other"))[0] == 404
    finally:
        await runner.cleanup()
    assert port_is_free(port), "kopf's liveness endpoint could not bind the port after the standby server"


async def test_operator_waiting_for_the_lease_is_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = asyncio.Event()

    async def acquire_never(self: object) -> None:
        waiting.set()
        await asyncio.Event().wait()  # another replica holds the Lease

    monkeypatch.setattr(main.LeaderElector, "acquire", acquire_never)
    port, metrics_port = free_port(), free_port()
    options = OperatorOptions(
        liveness=f"http://127.0.0.1:{port}/healthz",
        lease_namespace="inflight-system",
        metrics_address=f"127.0.0.1:{metrics_port}",
    )
    never_called = KubeClient(configuration_for("http://127.0.0.1:9"), user_agent=OPERATOR_USER_AGENT)
    operator = asyncio.create_task(main.run(options, client=never_called))
    try:
        await asyncio.wait_for(waiting.wait(), timeout=60)  # hang guard
        status, body = await get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200 and body["leader"] is False
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # a standby serves its (idle) metrics too
        async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
            assert response.status == 200
            assert "inflight_operator_reconciles_total" in await response.text()
    finally:
        operator.cancel()
        with pytest.raises(asyncio.CancelledError):
            await operator
    assert port_is_free(port) and port_is_free(metrics_port)
