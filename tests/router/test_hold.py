"""Holding requests for a model without a ready replica: wake, bounded queue, timeout, a client that
leaves (no servers)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from starlette.types import Message

from inflight.openai_errors import APIError
from inflight.router.app import Router, RouterApp, RouterSettings
from inflight.router.pool import ModelPool
from inflight.router.static import static_discovery


async def test_a_held_request_goes_on_when_a_replica_appears_and_the_model_is_woken_once() -> None:
    router = Router(RouterSettings())
    wakes: list[int] = []

    async def wake() -> None:
        wakes.append(1)

    pool = router.pools["m"] = ModelPool("m", hold_timeout_s=60, wake=wake)
    held = asyncio.create_task(router.hold(pool))
    await asyncio.sleep(0.05)
    assert not held.done() and pool.held == 1 and wakes == [1]
    pool.set_replicas({"a": "http://a"})
    await asyncio.wait_for(held, 5)
    assert pool.held == 0


async def test_hold_timeout_and_a_full_queue_answer_503_with_retry_after() -> None:
    router = Router(RouterSettings(max_held=1))
    pool = router.pools["m"] = ModelPool("m", hold_timeout_s=0.2)
    first = asyncio.create_task(router.hold(pool))
    await asyncio.sleep(0.05)
    with pytest.raises(APIError) as full:
        await router.hold(pool)  # the queue (1) is taken
    assert full.value.status == 503 and full.value.headers == {"Retry-After": "10"}
    with pytest.raises(APIError) as late:
        await first
    assert late.value.status == 503 and late.value.code == "no_replica"
    assert "within 0.2s" in late.value.message


async def test_a_held_request_whose_client_leaves_stops_waiting_at_once() -> None:
    router = Router(RouterSettings())
    app = RouterApp(router, static_discovery({"m": []}, hold_timeout_s=600))
    messages: list[Message] = [{"type": "http.request", "body": b'{"model": "m", "prompt": "x"}'}]
    client_left = asyncio.Event()

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await client_left.wait()
        return {"type": "http.disconnect"}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    async with app.rest.router.lifespan_context(app.rest):
        call = asyncio.create_task(app(scope, receive, send))
        pool = await wait_for_pool(router, "m")
        await wait_until(lambda: pool.held == 1)
        client_left.set()
        await asyncio.wait_for(call, 60)  # not the 600 s hold timeout
    assert pool.held == 0 and sent == []  # nobody to answer


async def wait_for_pool(router: Router, model: str) -> ModelPool:
    await wait_until(lambda: model in router.pools)
    return router.pools[model]


async def wait_until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.01)
