"""S3 (and S3-compatible stores) as a download source: `s3://BUCKET/PREFIX` or `s3://BUCKET/PREFIX/FILE.gguf`.

Needs boto3, which inflight does not install (`pip install boto3`, or the `inflight[s3]` extra). Credentials
and the endpoint come from boto3's usual chain: AWS_* variables, a web identity (IRSA / workload identity),
the instance profile; AWS_ENDPOINT_URL for MinIO and other S3-compatible stores. Listings give sizes (no
checksums: S3 ETags are not content hashes for multipart uploads), and ranged GETs resume a file.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from inflight.download.errors import DownloadError, ExitCode, TransientError
from inflight.download.files import RemoteFile
from inflight.download.hub import CHUNK_BYTES

AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "403", "401"}
NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "404"}


def s3_client() -> Any:
    try:
        boto3 = importlib.import_module("boto3")
    except ImportError:
        raise DownloadError(
            ExitCode.MISSING_DEPENDENCY,
            "s3:// sources need boto3, which is not installed: `pip install boto3` (or `inflight[s3]`), or "
            "fetch with `aws s3 sync` instead",
        ) from None
    return boto3.client("s3")


def _error(error: Exception, what: str) -> Exception:
    """boto3's exceptions (matched by shape: botocore is optional) -> DownloadError or TransientError."""
    code = str(getattr(error, "response", {}).get("Error", {}).get("Code", ""))
    name = type(error).__name__
    if code in AUTH_CODES or name in ("NoCredentialsError", "PartialCredentialsError"):
        return DownloadError(
            ExitCode.AUTH, f"{what}: {name} {code}: check the pod's AWS credentials and the bucket policy"
        )
    if code in NOT_FOUND_CODES:
        return DownloadError(ExitCode.NOT_FOUND, f"{what}: {code}: check the bucket and prefix")
    return TransientError(f"{what}: {name} {code}".strip())


class S3Source:
    commit = None

    def __init__(self, source: str, client: Any) -> None:
        path = source.removeprefix("s3://")
        bucket, _, prefix = path.partition("/")
        prefix = prefix.strip("/")
        if not bucket:
            raise DownloadError(ExitCode.USAGE, f"{source!r}: expected s3://BUCKET/PREFIX")
        self.gguf: str | None = None
        if prefix.endswith(".gguf"):
            prefix, _, self.gguf = prefix.rpartition("/")
        self.source = source
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self._client = client

    def describe(self) -> str:
        return self.source

    def files(self) -> list[RemoteFile]:
        found: list[RemoteFile] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for item in page.get("Contents") or []:
                    name = str(item["Key"])[len(self.prefix) :]
                    if name and not name.endswith("/"):
                        found.append(RemoteFile(name=name, size=int(item["Size"])))
        except Exception as error:
            raise _error(error, f"listing s3://{self.bucket}/{self.prefix}") from None
        if not found:
            raise DownloadError(
                ExitCode.NOT_FOUND, f"nothing under {self.source}: check the bucket and prefix"
            )
        return found

    @contextlib.contextmanager
    def stream(self, file: RemoteFile, offset: int) -> Iterator[tuple[int, Iterator[bytes]]]:
        request: dict[str, Any] = {"Bucket": self.bucket, "Key": self.prefix + file.name}
        if offset:
            request["Range"] = f"bytes={offset}-"
        try:
            response = self._client.get_object(**request)
        except Exception as error:
            if offset and str(getattr(error, "response", {}).get("Error", {}).get("Code")) == "InvalidRange":
                yield offset, iter(())
                return
            raise _error(error, file.name) from None
        body = response["Body"]
        try:
            yield (offset if response.get("ContentRange") else 0), _chunks(body, file.name)
        finally:
            body.close()


def _chunks(body: Any, name: str) -> Iterator[bytes]:
    try:
        yield from body.iter_chunks(CHUNK_BYTES)
    except Exception as error:  # a dropped connection (botocore's ReadTimeoutError, ...)
        raise _error(error, name) from None
