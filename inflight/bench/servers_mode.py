"""`inflight bench serve --servers`: its choices and `auto`'s memory margin, in a module of their own so
that the CLI reads them without importing the benchmark (bench/served.py)."""

from __future__ import annotations

TOGETHER, ONE_AT_A_TIME = "together", "one-at-a-time"
SERVERS_CHOICES = ("auto", TOGETHER, ONE_AT_A_TIME)
# The memory estimates are rough (allocator slack, the runtimes' own): `auto` runs the servers together
# only when they need at most this share of the memory available.
MEMORY_MARGIN = 0.9
