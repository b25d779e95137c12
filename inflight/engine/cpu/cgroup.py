"""A limit a process's cgroup sets (the CPU time or the memory a container may use), read as Linux states
it: /proc/self/cgroup names the process's cgroup in each hierarchy (`0::PATH` for cgroup v2, `N:CONTROLLERS:
PATH` for a v1 controller), mounted under /sys/fs/cgroup. An ancestor's limit binds too, so the smallest
along the path counts; a container with its own cgroup namespace sees its cgroup at the mount itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Reads one cgroup directory's limit; None where it sets none (or the file is absent).
LimitReader = Callable[[Path], float | None]


def _smallest_along(mount: Path, cgroup_path: str, read: LimitReader) -> float | None:
    """The smallest limit `read` finds in the process's cgroup directory under `mount` and its ancestors,
    and in `mount` itself (a container's own cgroup where the host's path is not visible in it)."""
    directories = [mount]
    relative = Path(cgroup_path.lstrip("/"))
    if relative.parts and (mount / relative).is_dir():
        directories += [mount / relative, *(mount / p for p in relative.parents if p != Path("."))]
    limits = [limit for d in directories if (limit := read(d)) is not None]
    return min(limits) if limits else None


def cgroup_limit(
    v1_controller: str, read_v2: LimitReader, read_v1: LimitReader, proc_cgroup: Path, root: Path
) -> float | None:
    """The smallest limit over the process's cgroup v2 path (`read_v2`) and its v1 `v1_controller`
    hierarchy (`read_v1`), or None: no limit, or no cgroup information (not Linux, cgroups not mounted)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            found = _smallest_along(root, path, read_v2)
        elif v1_controller in controllers.split(","):
            mount = root / controllers if (root / controllers).is_dir() else root / v1_controller
            found = _smallest_along(mount, path, read_v1)
        else:
            continue
        if found is not None:
            limits.append(found)
    return min(limits) if limits else None
