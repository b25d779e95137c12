"""Progress lines a log reader can follow: bytes done / total overall and for the current file.

One `progress` line at most every `interval` seconds, plus one line per finished file. The operator reads
the last `progress DONE/TOTAL bytes` of the download Job's log for the ModelServer's status.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TextIO

PROGRESS_LINE = re.compile(r"^progress (\d+)/(\d+) bytes")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_progress(log: str) -> tuple[int, int] | None:
    """(done, total) of the last progress line in a log, or None."""
    for line in reversed(log.splitlines()):
        match = PROGRESS_LINE.match(line)
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


class Progress:
    """Counts bytes; prints nothing until `start` gives the total (files fetched before count as done)."""

    def __init__(self, out: TextIO, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = 0
        self.done = 0
        self._out = out
        self._interval = interval
        self._clock = clock
        self._started = clock()
        self._last: float | None = None
        self._running = False

    def start(self, total: int) -> None:
        self.total = total
        self._running = True

    def _print(self, line: str) -> None:
        print(line, file=self._out, flush=True)

    def advance(self, n: int, name: str, file_done: int, file_total: int | None) -> None:
        self.done += n
        now = self._clock()
        if not self._running:
            return
        if self._last is not None and now - self._last < self._interval:
            return
        self._last = now
        rate = self.done / max(now - self._started, 1e-9)
        percent = 100 * self.done / self.total if self.total else 100.0
        of = f"/{file_total}" if file_total is not None else ""
        self._print(
            f"progress {self.done}/{self.total} bytes {percent:.1f}% ({human(self.done)} of "
            f"{human(self.total)}) | {name} {file_done}{of} | {human(rate)}/s"
        )

    def file_finished(self, name: str, size: int, how: str) -> None:
        if self._running:
            self._print(f"file {name} {size} bytes {how}")

    def finished(self) -> None:
        self._last = None
        self.advance(0, "all files", self.total, self.total)
        seconds = self._clock() - self._started
        self._print(f"complete {self.done} bytes in {seconds:.1f} s")
