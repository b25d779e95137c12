"""Lease leader election against the emulator: one leader, preconditioned writes, takeover after expiry."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from inflight.operator import leader
from inflight.operator.kube import OPERATOR_USER_AGENT, KubeClient, configuration_for
from inflight.operator.leader import LeaderElector

from support.emulated import emulated_cluster

LEASES = "coordination.k8s.io/v1/leases"


class Clock:
    """The Lease clock, moved only by the test: expiry never depends on how fast the machine runs."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    frozen = Clock()

    class TestDatetime(datetime):
        @classmethod
        def now(cls, tz: object = None) -> datetime:  # type: ignore[override]
            return frozen.now

    monkeypatch.setattr(leader, "datetime", TestDatetime)
    return frozen


def elector(url: str, identity: str, lease_seconds: int = 1) -> LeaderElector:
    client = KubeClient(configuration_for(url), user_agent=OPERATOR_USER_AGENT)
    return LeaderElector(
        client, "ops", identity, lease_seconds=lease_seconds, renew_seconds=0.1, retry_seconds=0.05
    )


async def test_one_leader_renews_and_a_follower_takes_over_after_expiry(clock: Clock) -> None:
    async with emulated_cluster() as cluster:
        a, b = elector(str(cluster.url), "a"), elector(str(cluster.url), "b")
        try:
            assert await a.try_acquire_or_renew()
            assert not await b.try_acquire_or_renew()
            assert await a.try_acquire_or_renew()  # renewal
            lease = cluster.stored(LEASES, "ops", "inflight-operator")
            assert lease is not None and lease["spec"]["holderIdentity"] == "a"

            clock.advance(1.2)  # a stops renewing; the lease expires
            assert await b.try_acquire_or_renew()
            lease = cluster.stored(LEASES, "ops", "inflight-operator")
            assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
            assert not await a.try_acquire_or_renew()
            await asyncio.wait_for(a.hold(), 60)  # the deposed leader notices and steps down (hang guard)
        finally:
            await a.client.close()
            await b.client.close()


async def test_concurrent_takeover_has_exactly_one_winner(clock: Clock) -> None:
    async with emulated_cluster() as cluster:
        electors = [elector(str(cluster.url), name) for name in "abcd"]
        try:
            results = await asyncio.gather(*(e.try_acquire_or_renew() for e in electors))
            assert sum(results) == 1
            clock.advance(1.2)
            results = await asyncio.gather(*(e.try_acquire_or_renew() for e in electors))
            assert sum(results) == 1
        finally:
            for e in electors:
                await e.client.close()


async def test_acquire_waits_for_the_leader_to_go(clock: Clock) -> None:
    async with emulated_cluster() as cluster:
        a, b = (
            elector(str(cluster.url), "a", lease_seconds=3),
            elector(str(cluster.url), "b", lease_seconds=3),
        )
        try:
            await a.acquire()
            waiting = asyncio.create_task(b.acquire())
            await asyncio.sleep(0.5)  # b retries every 0.05 s meanwhile
            assert not waiting.done()  # a's lease is fresh: no time passed on the Lease clock
            clock.advance(3.1)  # a never renews: the lease expires
            await asyncio.wait_for(waiting, 60)  # b gets it on its next try (hang guard)
            assert cluster.stored(LEASES, "ops", "inflight-operator")["spec"]["holderIdentity"] == "b"
        finally:
            await a.client.close()
            await b.client.close()
