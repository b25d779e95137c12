"""Exit codes of `inflight download`: one per kind of failure, so a Job's pod status says what went wrong."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # anything unexpected (a bug): the traceback is printed
    USAGE = 2  # a bad source or flag, or a repository without weights the engine can load
    AUTH = 3  # HTTP 401/403: no token, a rejected token, or a gated repository not accepted
    NOT_FOUND = 4  # HTTP 404: no such repository, revision or file
    DISK_FULL = 5  # not enough free space at the destination (checked up front, or ENOSPC)
    CHECKSUM = 6  # a file's size or sha256 differs from the source's metadata
    NETWORK = 7  # connection errors, timeouts or HTTP 5xx/429 after every retry
    MISSING_DEPENDENCY = 8  # s3:// without boto3 installed

    @property
    def kind(self) -> str:
        """What failed, in words, for the error line."""
        return self.name.lower().replace("_", " ").replace("auth", "authentication")


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
