"""The CPU time a container may use (its cgroup's CPU limit), and the engine's threads fitted to it.

torch starts one OpenMP thread per core it can see, and a Kubernetes pod (or `docker run --cpus`) sees
every core of its node while its CPU limit lets it use only a few CPUs' time: 32 busy threads under a
4-CPU limit use up each period's quota in an eighth of it, and the whole container then waits for the
next period (CFS throttling). Linux states the limit in the process's cgroup: cgroup v2's `cpu.max`
("QUOTA PERIOD", or "max PERIOD" for none), cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1:
none); an ancestor's limit binds too, so the smallest along the path counts (engine/cpu/cgroup.py).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from inflight.engine.cpu.cgroup import CGROUP_ROOT, PROC_CGROUP, cgroup_limit

logger = logging.getLogger("inflight.engine")


def _v2_limit(directory: Path) -> float | None:
    """CPUs allowed by `cpu.max` in a cgroup v2 directory; None where the file is absent or says max."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)


def _v1_limit(directory: Path) -> float | None:
    """CPUs allowed by a cgroup v1 cpu directory's CFS quota; None where absent or -1."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The CPUs this process's cgroup lets it use at once (2.5 for a "2500m" limit), or None: no limit,
    or no cgroup information (not Linux, cgroups not mounted)."""
    return cgroup_limit("cpu", _v2_limit, _v1_limit, proc_cgroup, root)


def threads_for_limit(limit: float) -> int:
    """Threads that a CPU limit runs at once: whole CPUs only (a thread more than the limit waits at every
    barrier for its throttled share), at least one."""
    return max(1, math.floor(limit))


def usable_cpus() -> int:
    """The CPUs this process can keep busy: those it may run on, fewer where its cgroup's limit is lower."""
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    return cpus if limit is None else min(cpus, threads_for_limit(limit))


def fit_threads_to_cpu_limit() -> None:
    """Lower torch's CPU threads to the CPUs the process can keep busy where they are fewer (a cgroup CPU
    limit below the cores it sees), unless the user chose a count with OMP_NUM_THREADS (theirs wins)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = usable_cpus()
    if torch.get_num_threads() > threads:
        logger.info(
            "CPU limit (cgroup) of %d CPUs is below torch's %d threads: running %d (OMP_NUM_THREADS chooses)",
            threads,
            torch.get_num_threads(),
            threads,
        )
        torch.set_num_threads(threads)
