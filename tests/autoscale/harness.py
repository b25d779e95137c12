"""The real operator for the autoscaling integration tests: in a thread with an event loop of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from inflight.operator.main import OperatorOptions, run


@contextlib.asynccontextmanager
async def running_operator(autoscale_seconds: float = 1.0) -> AsyncIterator[None]:
    stop = threading.Event()
    options = OperatorOptions(
        leader_election=False, liveness=None, autoscale_seconds=autoscale_seconds, scrape_timeout_seconds=1.0
    )
    outcome: list[int | BaseException] = []

    def target() -> None:
        try:
            outcome.append(asyncio.run(run(options, stop_flag=stop)))
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=target, name="operator")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "the operator did not stop"
        assert outcome == [0], outcome
