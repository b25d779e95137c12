"""Keep freed activation memory in the process (glibc malloc) instead of handing it back to the OS.

A prefill step's activations are megabytes per layer (SmolLM2's gate|up at 2048 tokens in bfloat16: 12 MB)
and torch allocates them from malloc afresh for every layer. glibc serves a block above its mmap threshold
with a new mmap and unmaps it on free, and gives the free top of its heaps back to the OS above its trim
threshold, so every layer of every step faulted its activations in again: about 200,000 minor page faults
per 2048-token SmolLM2 step, 29 % of the step's time (docs/benchmarks.md). With both thresholds raised once,
glibc reuses the memory: the process keeps one step's peak of activations resident, which the next step
needs anyway.

Blocks above 32 MiB (glibc's largest mmap threshold) are still mapped per allocation. Nothing is changed
where malloc is not glibc's, or where the user tuned it (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
MALLOC_TOP_PAD_, or any GLIBC_TUNABLES).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

logger = logging.getLogger("inflight.engine")

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB * sizeof(long)).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free heap top kept before trimming: more than any step's activations on CPU.
TRIM_THRESHOLD_BYTES = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_done = False


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process). Returns True when they are set now or
    were set by an earlier call; False where this is not glibc or the user tuned malloc themselves."""
    global _done
    with _lock:
        if _done:
            return True
        if platform.libc_ver()[0] != "glibc":
            return False
        user = [name for name in USER_SETTINGS if name in os.environ]
        if user:
            logger.info("malloc left as configured (%s set)", ", ".join(user))
            return False
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # mallopt returns 1 on success, 0 when glibc rejects the value.
        _done = (
            mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
        )
        if not _done:
            logger.warning("glibc rejected the malloc thresholds; activations will be page-faulted per step")
        return _done
