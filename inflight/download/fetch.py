"""Fetch a checkpoint's files into a folder: resumable (`NAME.part` + Range), verified, with progress.

A file is written to `NAME.part`, checked against the source's size and sha256 (or git blob id), and
renamed to `NAME` only then: a present `NAME` is complete. An interrupted run leaves the `.part` file and
the next run continues it. `.inflight-download.json` is written last and marks the folder complete for
this source and revision: a later run (a restarted Job) finds it and touches no network.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO, TypeVar

from inflight.download.errors import DownloadError, ExitCode, TransientError
from inflight.download.files import SAFETENSORS_INDEX, RemoteFile, select_support_files, select_weights
from inflight.download.progress import Progress, human

MARKER = ".inflight-download.json"
HASH_CHUNK = 8 << 20
T = TypeVar("T")


class Source(Protocol):
    """Where files come from (the Hub, S3): list them, stream one from an offset."""

    @property
    def gguf(self) -> str | None: ...

    def describe(self) -> str: ...

    def files(self) -> list[RemoteFile]: ...

    def stream(
        self, file: RemoteFile, offset: int
    ) -> contextlib.AbstractContextManager[tuple[int, Iterator[bytes]]]: ...


@dataclass
class Options:
    retries: int = 5
    retry_wait: float = 1.0  # doubled after each retry, at most 30 s
    progress_interval: float = 5.0
    out: TextIO = field(default_factory=lambda: sys.stdout)


def marker_matches(dest: Path, source_id: str) -> bool:
    """Whether `dest` holds a complete download of `source_id` (the marker and every file it lists)."""
    try:
        marker = json.loads((dest / MARKER).read_text())
        return bool(marker["source"] == source_id) and all(
            (dest / f["name"]).is_file() and (dest / f["name"]).stat().st_size == f["size"]
            for f in marker["files"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _with_retries(what: str, call: Callable[[], T], options: Options) -> T:
    for attempt in range(options.retries + 1):
        try:
            return call()
        except TransientError as error:
            if attempt == options.retries:
                raise DownloadError(
                    ExitCode.NETWORK,
                    f"{what}: {error}; gave up after {options.retries} retries (run again: it resumes)",
                ) from None
            wait = min(options.retry_wait * 2**attempt, 30.0)
            print(f"retry {attempt + 1}/{options.retries} in {wait:g} s: {what}: {error}", file=options.out)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _part(dest: Path, file: RemoteFile) -> Path:
    return dest / f"{file.name}.part"


def _present(dest: Path, file: RemoteFile) -> bool:
    final = dest / file.name
    return final.is_file() and (file.size is None or final.stat().st_size == file.size)


def _disk_full(dest: Path, file: RemoteFile, error: OSError) -> DownloadError:
    return DownloadError(
        ExitCode.DISK_FULL,
        f"no space left in {dest} while writing {file.name} ({error.strerror}); free space or grow the "
        "volume and run again: the download resumes",
    )


class Checksum:
    """The digest the source publishes for a file (sha256, else the git blob id), fed as bytes are written."""

    def __init__(self, file: RemoteFile) -> None:
        self.file = file
        self.length = 0
        self._digest = self._new()

    def _new(self) -> hashlib._Hash | None:
        if self.file.sha256 is not None:
            return hashlib.sha256()
        if self.file.git_sha1 is not None and self.file.size is not None:
            return hashlib.sha1(f"blob {self.file.size}\0".encode())
        return None

    def restart(self, part: Path, length: int) -> None:
        """Start over from the first `length` bytes of the .part file (a resume in a new run)."""
        self._digest, self.length = self._new(), 0
        if length and self._digest is not None:
            with open(part, "rb") as f:
                while self.length < length and (chunk := f.read(min(HASH_CHUNK, length - self.length))):
                    self.update(chunk)
        self.length = length

    def update(self, chunk: bytes) -> None:
        if self._digest is not None:
            self._digest.update(chunk)
        self.length += len(chunk)

    def problem(self) -> str | None:
        """Why the bytes are not the published ones, or None."""
        if self._digest is None:
            return None
        actual = self._digest.hexdigest()
        if self.file.sha256 is not None:
            return (
                None if actual == self.file.sha256 else f"sha256 {actual}, the source says {self.file.sha256}"
            )
        return (
            None
            if actual == self.file.git_sha1
            else f"git blob id {actual}, the source says {self.file.git_sha1}"
        )


def _transfer(source: Source, file: RemoteFile, dest: Path, progress: Progress, checksum: Checksum) -> None:
    """Append the rest of `file` to its .part file (from byte 0 when the server ignores the Range)."""
    part = _part(dest, file)
    offset = part.stat().st_size if part.exists() else 0
    if file.size is not None and offset > file.size:
        offset = 0
    with source.stream(file, offset) as (start, chunks):
        if start != offset:  # no Range support: start over
            progress.advance(-offset, file.name, 0, file.size)
            offset = 0
        if checksum.length != offset:
            checksum.restart(part, offset)
        try:
            with open(part, "ab" if offset else "wb", buffering=0) as out:
                for chunk in chunks:
                    view = memoryview(chunk)
                    while view:
                        view = view[out.write(view) or 0 :]
                    checksum.update(chunk)
                    offset += len(chunk)
                    progress.advance(len(chunk), file.name, offset, file.size)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _disk_full(dest, file, error) from None
            raise
    if file.size is not None and offset < file.size:
        raise TransientError(f"{file.name}: the body ended after {offset} of {file.size} bytes")


def _verify(file: RemoteFile, part: Path, checksum: Checksum) -> str:
    """Check the finished .part against the source's size and checksum; delete it when wrong."""
    size = part.stat().st_size
    if file.size is not None and size != file.size:
        problem: str | None = f"{size} bytes, the source says {file.size}"
    else:
        if checksum.length != size:  # e.g. a server without Range support appended to an old part
            checksum.restart(part, size)
        problem = checksum.problem()
    if problem is not None:
        part.unlink()
        raise DownloadError(
            ExitCode.CHECKSUM,
            f"{file.name} is corrupt: {problem}; the partial file was deleted, run again to fetch it anew "
            "(if it fails again, the source or a proxy serves wrong bytes)",
        )
    return "sha256 ok" if file.sha256 else ("git blob id ok" if file.git_sha1 else "size ok")


def _fetch(source: Source, file: RemoteFile, dest: Path, progress: Progress, options: Options) -> None:
    if _present(dest, file):
        size = (dest / file.name).stat().st_size
        progress.advance(size, file.name, size, size)
        progress.file_finished(file.name, size, "already present")
        return
    part = _part(dest, file)
    if part.exists():  # counted as done: resumed bytes are not fetched again
        held = part.stat().st_size
        progress.advance(held, file.name, held, file.size)
        print(f"resuming {file.name} at byte {held}", file=options.out, flush=True)
    checksum = Checksum(file)
    _with_retries(file.name, lambda: _transfer(source, file, dest, progress, checksum), options)
    how = _verify(file, part, checksum)
    os.replace(part, dest / file.name)
    progress.file_finished(file.name, (dest / file.name).stat().st_size, how)


def _check_space(dest: Path, files: list[RemoteFile]) -> None:
    needed = 0
    for f in files:
        if f.size is None or _present(dest, f):
            continue
        part = _part(dest, f)
        needed += f.size - (part.stat().st_size if part.exists() else 0)
    free = shutil.disk_usage(dest).free
    if needed > free:
        raise DownloadError(
            ExitCode.DISK_FULL,
            f"{dest} has {human(free)} free but the download needs {human(needed)} more; grow the volume "
            "(model.cache.pvc.size) or free space",
        )


def download(source: Source, source_id: str, dest: Path, options: Options) -> None:
    """Fetch what the engine needs from `source` into `dest`; `source_id` names it in the marker."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DownloadError(ExitCode.USAGE, f"cannot create {dest}: {error.strerror}") from None
    if marker_matches(dest, source_id):
        print(f"already complete: {dest} holds {source_id} ({MARKER})", file=options.out, flush=True)
        return
    listing = _with_retries("listing the files", source.files, options)
    support = select_support_files(listing, source.gguf)
    progress = Progress(options.out, options.progress_interval)
    index = [f for f in support if f.name == SAFETENSORS_INDEX]
    for file in index:  # first: it names the shards to fetch
        _fetch(source, file, dest, progress, options)
    plan = [f for f in support if f.name != SAFETENSORS_INDEX] + select_weights(listing, source.gguf, dest)
    _check_space(dest, plan)
    progress.start(progress.done + sum(f.size or 0 for f in plan))
    print(
        f"downloading {source.describe()}: {len(plan)} files, {human(progress.total)} into {dest}",
        file=options.out,
        flush=True,
    )
    for file in plan:
        _fetch(source, file, dest, progress, options)
    everything = index + plan
    marker = {
        "source": source_id,
        "commit": getattr(source, "commit", None),
        "files": [
            {"name": f.name, "size": (dest / f.name).stat().st_size, "sha256": f.sha256} for f in everything
        ],
    }
    tmp = dest / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    os.replace(tmp, dest / MARKER)
    progress.finished()
