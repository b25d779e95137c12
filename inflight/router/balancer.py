"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018), pure.

Every replica sits on a hash ring at `VIRTUAL_NODES` points. A request's routing key hashes to a point;
the replicas are tried clockwise from there, and the first one whose load stays within the bound takes
the request. The bound is `ceil((1 + epsilon) * (total load + 1) / replicas)`: the new request counted,
no replica carries more than (1 + epsilon) times the mean. The same key finds the same replica while it
has room (its prefix cache holds the conversation), and a hot key spills over to its ring neighbours
instead of piling onto one replica. Replicas joining or leaving move only the keys next to them.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

VIRTUAL_NODES = 64


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (Python's `hash` of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def load_bound(total_load: float, replicas: int, epsilon: float) -> int:
    """The most load one replica may carry after taking one more request."""
    return math.ceil((1 + epsilon) * (total_load + 1) / replicas)


@dataclass(frozen=True)
class Choice:
    replica: str
    affinity: bool
    """True when the key's own replica (the first on the ring) took it; False when it spilled over."""


class HashRing:
    """The ring of one model's replicas (by id); rebuild it when the set changes."""

    def __init__(self, replicas: Sequence[str]) -> None:
        if not replicas:
            raise ValueError("a hash ring needs at least one replica")
        points = sorted(
            (stable_hash(f"{replica}#{i}"), replica)
            for replica in set(replicas)
            for i in range(VIRTUAL_NODES)
        )
        self._hashes = [point for point, _ in points]
        self._owners = [owner for _, owner in points]
        self.replicas = frozenset(replicas)

    def order(self, key: str) -> list[str]:
        """The replicas in ring order from the key's point: the key's own replica first."""
        start = bisect.bisect(self._hashes, stable_hash(key))
        seen: list[str] = []
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.replicas):
                    break
        return seen

    def choose(self, key: str, loads: Mapping[str, float], epsilon: float) -> Choice:
        """The first replica in ring order whose load + 1 stays within the bound (one always does)."""
        order = self.order(key)
        bound = load_bound(sum(loads.get(r, 0.0) for r in order), len(order), epsilon)
        for position, replica in enumerate(order):
            if loads.get(replica, 0.0) + 1 <= bound:
                return Choice(replica, affinity=position == 0)
        # Unreachable for loads >= 0 (the bound is at least the mean + 1); the least loaded one then.
        return Choice(min(order, key=lambda r: loads.get(r, 0.0)), affinity=False)
