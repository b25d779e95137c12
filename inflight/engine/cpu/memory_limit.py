"""The memory a container may use (its cgroup's memory limit), and the KV blocks a CPU engine has room
for within it.

On CPU the KV pool is as many blocks as the engine is told (`--num-kv-blocks`, which the operator plans
from the container's memory) or what `kv_cache_memory_gib` holds. Where the weights already loaded, that
pool and a step's activations together pass the container's memory limit, the kernel kills the server
(OOMKilled) once the pool is written; a GPU engine re-measures its free memory before it allocates the
pool, and a CPU engine does the same against this limit: cgroup v2's `memory.max` (bytes, or "max" for
none), cgroup v1's `memory.limit_in_bytes` (2^63 rounded down to a page for none).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from inflight.engine.cpu.cgroup import CGROUP_ROOT, PROC_CGROUP, cgroup_limit

# cgroup v1 writes 9223372036854771712 for "no limit"; anything this large is none.
V1_NO_LIMIT = 2**62
PROC_STATM = Path("/proc/self/statm")


def _v2_limit(directory: Path) -> float | None:
    try:
        text = (directory / "memory.max").read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else float(text)


def _v1_limit(directory: Path) -> float | None:
    try:
        limit = int((directory / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return None if limit >= V1_NO_LIMIT else float(limit)


def cgroup_memory_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The bytes this process's cgroup lets it (and the rest of its container) hold, or None: no limit, or
    no cgroup information."""
    limit = cgroup_limit("memory", _v2_limit, _v1_limit, proc_cgroup, root)
    return None if limit is None else int(limit)


def resident_bytes(statm: Path = PROC_STATM) -> int:
    """This process's resident memory now (its weights, runtime and everything else it has touched)."""
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def blocks_within_limit(
    block_bytes: int, step_bytes: int, other_pids: Sequence[int] = ()
) -> tuple[int, str] | None:
    """KV blocks of `block_bytes` the container's memory limit leaves room for beside the resident memory
    of this process and of `other_pids` (a tensor-parallel engine's workers, in the same container) and
    `step_bytes` of a step's activations, with the figures as words for a log line; None where the
    container has no memory limit."""
    limit = cgroup_memory_limit()
    if limit is None:
        return None
    resident = resident_bytes() + sum(resident_bytes(Path(f"/proc/{pid}/statm")) for pid in other_pids)
    room = limit - resident - step_bytes
    gib = 2**30
    processes = f" in the engine's {1 + len(other_pids)} processes" if other_pids else ""
    words = (
        f"the container's memory limit of {limit / gib:.2f} GiB, {resident / gib:.2f} GiB resident"
        f"{processes} and {step_bytes / gib:.2f} GiB kept for a step's activations"
    )
    return max(0, room // block_bytes), words
