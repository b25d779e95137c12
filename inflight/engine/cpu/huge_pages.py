"""Transparent huge pages (2 MiB) under the memory a CPU engine streams in every decode step: the weights
the C products read and the KV caches.

A decode step reads every weight and every cached K/V row of its sequences from memory, at addresses the
page tables translate 4 KiB at a time, so the TLB misses every few rows and loads and prefetches wait on
page walks. On 2 MiB pages a SmolLM2 decode step of one to four rows took 7-17 % less time on a Sapphire
Rapids Xeon (docs/benchmarks.md). Linux gives anonymous memory huge pages by itself
where /sys/kernel/mm/transparent_hugepage/enabled is `always`; where it is `madvise` (a common default)
only ranges advised with MADV_HUGEPAGE get them; where it is `never`, none do. So:
- `advise` marks the pages of tensors not written yet (the weights before loading, the KV pool before
  zeroing: `zeros`, one allocation for every layer's caches): they fault in as huge pages, without a
  copy;
- `hold_on_huge_pages` moves the pages of tensors already written into huge pages at once (MADV_COLLAPSE,
  Linux 6.1+: a copy, ~3 ms a page), advising them too, so that the kernel's background collapsing
  (khugepaged) takes them later where it refused now.
They act on the huge pages a tensor's bytes lie in, so memory beside a tensor in those pages moves with it
(its contents unchanged). Nothing is done off Linux, for tensors not on the CPU, or where THP is `never`;
a page the kernel refuses stays in 4 KiB pages, and the log line says how many it refused and why.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import math
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import torch

logger = logging.getLogger("inflight.engine")

HUGE_PAGE_BYTES = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Linux's madvise advice values (asm-generic/mman-common.h).
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The selected transparent huge page mode (`always`, `madvise` or `never`), or None where the kernel
    has none (not Linux, or THP not built)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    selected = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return selected[0] if selected else None


def enclosing_pages(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The addresses of the huge pages the CPU `tensors`' bytes lie in, in order, each once."""
    pages: set[int] = set()
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        pages.update(range(start // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, end, HUGE_PAGE_BYTES))
    return sorted(pages)


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int]:
    """libc's madvise(2), typed once (it is called for every page)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], madvise)


def _madvise(page: int, advice: int) -> int:
    """madvise(2) of one huge page: 0, or the errno it failed with."""
    return 0 if _libc_madvise()(page, HUGE_PAGE_BYTES, advice) == 0 else ctypes.get_errno()


def _pages(tensors: Iterable[torch.Tensor]) -> list[int]:
    """enclosing_pages, where huge pages can be asked for here; else none."""
    usable = platform.system() == "Linux" and thp_mode() not in (None, "never")
    return enclosing_pages(tensors) if usable else []


def advise(tensors: Iterable[torch.Tensor]) -> None:
    """Ask for huge pages where `tensors` lie, before their memory is first written."""
    for page in _pages(tensors):
        _madvise(page, MADV_HUGEPAGE)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """A zeroed CPU tensor that starts on a huge page (one page more is allocated): its pages are advised
    before they are zeroed, so that fresh memory faults in as huge pages; what did not (memory malloc had
    used before) is then collapsed, and logged as `what` (hold_on_huge_pages)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[start : start + nbytes].view(dtype).view(shape)
    advise([tensor])
    tensor.zero_()
    hold_on_huge_pages([tensor], what)
    return tensor


def collapse(tensors: Iterable[torch.Tensor]) -> tuple[int, Counter[str]]:
    """Put the pages `tensors` lie in on huge pages now (see the top of the file). Returns the bytes on huge
    pages, and the pages refused by the reason's errno name. A page not wholly mapped is left alone."""
    collapsed, refused = 0, Counter[str]()
    for page in _pages(tensors):
        error = _madvise(page, MADV_HUGEPAGE) or _madvise(page, MADV_COLLAPSE)
        if error == errno.ENOMEM:  # part of the page is not mapped
            continue
        if error:  # EINVAL: no MADV_COLLAPSE in this kernel, or a page it cannot collapse
            refused[errno.errorcode.get(error, str(error))] += 1
            continue
        collapsed += HUGE_PAGE_BYTES
    return collapsed, refused


def hold_on_huge_pages(tensors: Iterable[torch.Tensor], what: str) -> None:
    """`collapse`, logged: how much of `what` (e.g. "weights") is on huge pages, and what was refused."""
    started = time.perf_counter()
    collapsed, refused = collapse(tensors)
    if not collapsed and not refused:
        return
    pages = sum(refused.values())
    reasons = ", ".join(reason if pages == 1 else f"{reason} {n}" for reason, n in sorted(refused.items()))
    logger.info(
        "huge pages: %.0f MiB of %s in %.2f s%s",
        collapsed / 2**20,
        what,
        time.perf_counter() - started,
        f" ({pages} page{'' if pages == 1 else 's'} refused: {reasons})" if refused else "",
    )
