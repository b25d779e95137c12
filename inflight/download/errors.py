"""Exit codes of `inflight download`: one per kind of failure, so a Job's pod status says what went wrong."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    AUTH = 3
    NOT_FOUND = 4
    DISK_FULL = 5
    CHECKSUM = 6
    NETWORK = 7
    MISSING_DEPENDENCY = 8

    @property
    def kind(self) -> str:
        """What failed, in words, for the error line."""
        return self.name.lower().replace("_", " ").replace("auth", "authentication")


MEANINGS = {
    ExitCode.OK: "done (or DEST already held this source and revision)",
    ExitCode.FAILED: "unexpected error (a bug: the traceback is printed)",
    ExitCode.USAGE: "bad source or flags, or no weights the engine loads at the source",
    ExitCode.AUTH: "authentication: HTTP 401/403 (no token, a rejected token, a gated repository)",
    ExitCode.NOT_FOUND: "not found: HTTP 404 (repository, revision or file)",
    ExitCode.DISK_FULL: "disk full: not enough space at DEST (checked up front, or ENOSPC while writing)",
    ExitCode.CHECKSUM: "checksum: a file's size or sha256 differs from the source's metadata (the bad file "
    "is deleted)",
    ExitCode.NETWORK: "network: connection errors, timeouts, HTTP 5xx/429 after every retry (run again: it "
    "resumes)",
    ExitCode.MISSING_DEPENDENCY: "s3:// without boto3 installed",
}

# Codes a retry cannot fix: the operator's Job fails at once on them instead of backing off.
PERMANENT = (
    ExitCode.USAGE,
    ExitCode.AUTH,
    ExitCode.NOT_FOUND,
    ExitCode.CHECKSUM,
    ExitCode.MISSING_DEPENDENCY,
)


class DownloadError(Exception):
    """A failure with the exit code that names its kind and a message saying what to do."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TransientError(Exception):
    """A failure a retry may fix (a dropped connection, a timeout, HTTP 5xx or 429)."""
