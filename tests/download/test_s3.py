"""s3:// sources: boto3 is optional (a clear exit 8 without it); the transfer through a fake S3 client."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.cli import main
from inflight.download.errors import DownloadError, ExitCode
from inflight.download.fetch import Options, download
from inflight.download.s3 import S3Source


class Body:
    def __init__(self, data: bytes, drop_after: int | None) -> None:
        self.data, self.drop_after = data, drop_after

    def iter_chunks(self, size: int) -> Iterator[bytes]:
        if self.drop_after is not None:
            yield self.data[: self.drop_after]
            raise ConnectionResetError("dropped")
        yield self.data

    def close(self) -> None:
        pass


class ClientError(Exception):
    def __init__(self, code: str) -> None:
        self.response = {"Error": {"Code": code}}


class FakeS3:
    """list_objects_v2 (one page) and get_object with Range, as boto3's client answers."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.ranges: list[str | None] = []
        self.drop_once: dict[str, int] = {}

    def get_paginator(self, name: str) -> Any:
        assert name == "list_objects_v2"
        outer = self

        class Paginator:
            def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:
                if Bucket != "bucket":
                    raise ClientError("NoSuchBucket")
                keys = [k for k in outer.objects if k.startswith(Prefix)]
                return [{"Contents": [{"Key": k, "Size": len(outer.objects[k])} for k in keys]}]

        return Paginator()

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        self.ranges.append(Range)
        data = self.objects[Key]
        response: dict[str, Any] = {}
        if Range:
            start = int(re.fullmatch(r"bytes=(\d+)-", Range).group(1))  # type: ignore[union-attr]
            data = data[start:]
            response["ContentRange"] = f"bytes {start}-/{len(self.objects[Key])}"
        response["Body"] = Body(data, self.drop_once.pop(Key, None))
        return response


def test_s3_without_boto3_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    assert main(["download", "s3://bucket/models/x", str(tmp_path)]) == ExitCode.MISSING_DEPENDENCY == 8
    assert "pip install boto3" in capsys.readouterr().err


def test_s3_download_selects_and_resumes(tmp_path: Path) -> None:
    objects = {
        "models/x/config.json": b"{}",
        "models/x/tokenizer.json": b"{}",
        "models/x/model.safetensors": bytes(range(256)) * 400,
        "models/x/pytorch_model.bin": b"no",
        "other/y": b"no",
    }
    s3 = FakeS3(objects)
    s3.drop_once["models/x/model.safetensors"] = 30_000
    options = Options(retry_wait=0.0, progress_interval=0.0, out=io.StringIO())
    download(S3Source("s3://bucket/models/x", s3), "s3://bucket/models/x", tmp_path, options)
    assert (tmp_path / "model.safetensors").read_bytes() == objects["models/x/model.safetensors"]
    assert {p.name for p in tmp_path.iterdir()} == {
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        ".inflight-download.json",
    }
    assert s3.ranges[-2:] == [None, "bytes=30000-"]
    with pytest.raises(DownloadError) as error:
        download(S3Source("s3://nobucket/x", s3), "s3://nobucket/x", tmp_path / "n", options)
    assert error.value.code == ExitCode.NOT_FOUND
