"""The memory a CPU engine may still take (its container's cgroup memory limit, and the machine's available
memory), and the KV blocks it has room for within both.

On CPU the KV pool is as many blocks as the engine is told (`--num-kv-blocks`, which the operator plans
from the container's memory) or what `kv_cache_memory_gib` holds. Where the weights already loaded, that
pool and a step's activations together pass the container's memory limit, the kernel kills the server
(OOMKilled) once the pool is written; on a machine with no such limit (a VM, bare metal, a benchmark
run) the same happens past its physical memory. A GPU engine re-measures its free memory before it
allocates the pool, and a CPU engine does the same against both bounds: cgroup v2's `memory.max`
(bytes, or "max" for none) or cgroup v1's `memory.limit_in_bytes` (2^63 rounded down to a page for
none), less the engine's resident memory; and /proc/meminfo's MemAvailable (the kernel's estimate of
what can still be allocated without swapping: everything already resident, the engine's weights
included, is outside it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from inflight.engine.cpu.cgroup import CGROUP_ROOT, PROC_CGROUP, cgroup_limit

# cgroup v1 writes 9223372036854771712 for "no limit"; anything this large is none.
V1_NO_LIMIT = 2**62
PROC_STATM = Path("/proc/self/statm")
PROC_MEMINFO = Path("/proc/meminfo")


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


def available_memory_bytes(meminfo: Path = PROC_MEMINFO) -> int | None:
    """The kernel's estimate of the memory new allocations can have without swapping (MemAvailable); None
    where /proc/meminfo has no answer."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def blocks_within_limit(
    block_bytes: int, step_bytes: int, other_pids: Sequence[int] = ()
) -> tuple[int, str] | None:
    """KV blocks of `block_bytes` that fit beside `step_bytes` of a step's activations in the memory the
    engine may still take, with the bound that decides it as words for a log line; None where neither
    bound is known. The bounds: the container's memory limit less the resident memory of this process
    and of `other_pids` (a tensor-parallel engine's workers, in the same container), and the machine's
    available memory; the smaller binds."""
    gib = 2**30
    kept = f"{step_bytes / gib:.2f} GiB kept for a step's activations"
    rooms: list[tuple[int, str]] = []
    limit = cgroup_memory_limit()
    if limit is not None:
        resident = resident_bytes() + sum(resident_bytes(Path(f"/proc/{pid}/statm")) for pid in other_pids)
        processes = f" in the engine's {1 + len(other_pids)} processes" if other_pids else ""
        words = (
            f"the container's memory limit of {limit / gib:.2f} GiB, {resident / gib:.2f} GiB resident"
            f"{processes} and {kept}"
        )
        rooms.append((limit - resident - step_bytes, words))
    available = available_memory_bytes()
    if available is not None:
        words = f"the machine's available memory of {available / gib:.2f} GiB (MemAvailable) and {kept}"
        rooms.append((available - step_bytes, words))
    if not rooms:
        return None
    room, words = min(rooms)
    return max(0, room // block_bytes), words
