"""The replicas of every routed model, their load, and the choice of one for a request.

A `ModelPool` is one model's replica set as discovery last saw it (static `--upstream`s or the ready pods
of a ModelServer). Each `Replica` carries the router's own in-flight count and what the last `/metrics`
scrape said (waiting requests, KV-cache use). The load the balancer sees is in-flight + waiting: a replica
that queues (other clients, or slow steps) looks busier than the router's own count says. A replica whose
KV cache is nearly full, or that did not answer its last scrape or a connection, is passed over while
any other one is usable.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from inflight.router.balancer import Choice, HashRing

KV_FULL = 0.95


@dataclass(eq=False)
class Replica:
    id: str
    url: str
    in_flight: int = 0
    waiting: float = 0.0
    kv_usage: float = 0.0
    healthy: bool = True

    @property
    def load(self) -> float:
        return self.in_flight + self.waiting

    @property
    def usable(self) -> bool:
        return self.healthy and self.kv_usage < KV_FULL


Wake = Callable[[], Awaitable[None]]


@dataclass(eq=False)
class ModelPool:
    """One model: its replicas, how long a request may wait for one, and how to ask for one."""

    model: str
    hold_timeout_s: float
    wake: Wake | None = None
    """Asks the operator for a replica (scale from zero); None when the model cannot scale from zero."""
    replicas: dict[str, Replica] = field(default_factory=dict)
    held: int = 0
    _turn: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _rings: dict[frozenset[str], HashRing] = field(default_factory=dict)

    def set_replicas(self, urls: Mapping[str, str]) -> None:
        """Replace the set (id -> base URL); replicas that stay keep their counts."""
        kept = {rid: r for rid, r in self.replicas.items() if rid in urls and r.url == urls[rid]}
        self.replicas = {rid: kept.get(rid) or Replica(rid, url) for rid, url in urls.items()}
        self._rings.clear()
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout: float) -> None:
        """Until the replica set changes or `timeout` seconds pass."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def choose(self, key: str | None, epsilon: float, exclude: frozenset[str] = frozenset()) -> Choice | None:
        """A replica for a request with this routing key, or None when there is none to try."""
        candidates = [r for r in self.replicas.values() if r.id not in exclude]
        usable = [r for r in candidates if r.usable] or candidates
        if not usable:
            return None
        loads = {r.id: r.load for r in usable}
        if key is None:
            return Choice(min(usable, key=lambda r: (r.load, r.id)).id, affinity=False)
        ids = frozenset(loads)
        ring = self._rings.get(ids)
        if ring is None:
            ring = self._rings[ids] = HashRing(sorted(ids))
        return ring.choose(key, loads, epsilon)

    def next_in_turn(self, exclude: frozenset[str] = frozenset()) -> Choice | None:
        """Round robin over the usable replicas (the baseline the prefix policy is measured against)."""
        candidates = [r for r in self.replicas.values() if r.id not in exclude]
        usable = sorted(r.id for r in ([r for r in candidates if r.usable] or candidates))
        if not usable:
            return None
        self._turn += 1
        return Choice(usable[self._turn % len(usable)], affinity=False)
