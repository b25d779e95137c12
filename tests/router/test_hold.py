"""Holding requests for a model without a ready replica: wake, bounded queue, timeout (no servers)."""

from __future__ import annotations

import asyncio

import pytest

from inflight.router.app import Router, RouterSettings
from inflight.router.pool import ModelPool
from inflight.server.errors import APIError


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
