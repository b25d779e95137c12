"""The Hugging Face Hub as a download source: `hf://ORG/REPO` or `hf://ORG/REPO/FILE.gguf`.

Metadata comes from `GET {HF_ENDPOINT}/api/models/{repo}/revision/{revision}?blobs=true` (the commit and
every file's size, lfs.sha256 or git blob id); files from `{HF_ENDPOINT}/{repo}/resolve/{commit}/{file}`
with HTTP Range requests, so an interrupted file continues where it stopped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from inflight.download.errors import DownloadError, ExitCode, TransientError
from inflight.download.files import RemoteFile

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK_BYTES = 1 << 20


def hub_endpoint() -> str:
    """$HF_ENDPOINT (a mirror or a test server), else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def read_token(token_file: Path | None) -> str | None:
    """The token from --token-file, else $HF_TOKEN (or the older $HUGGING_FACE_HUB_TOKEN)."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as error:
            raise DownloadError(ExitCode.USAGE, f"--token-file {token_file}: {error.strerror}") from None
        if not token:
            raise DownloadError(ExitCode.USAGE, f"--token-file {token_file} is empty")
        return token
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


@dataclass(frozen=True)
class HubLocation:
    repo: str
    gguf: str | None  # one named GGUF file, or None for a safetensors checkpoint


def parse_hf_source(source: str) -> HubLocation:
    parts = [p for p in source.removeprefix("hf://").split("/") if p]
    gguf = parts.pop() if parts and parts[-1].endswith(".gguf") else None
    if not 1 <= len(parts) <= 2:
        raise DownloadError(ExitCode.USAGE, f"{source!r}: expected hf://ORG/REPO or hf://ORG/REPO/FILE.gguf")
    return HubLocation("/".join(parts), gguf)


def _hub_error(response: httpx.Response, what: str, token: str | None, repo: str) -> Exception:
    """The error for a failed Hub response: permanent ones as DownloadError, the rest as TransientError."""
    code = response.status_code
    detail = response.headers.get("X-Error-Message") or response.headers.get("X-Error-Code") or ""
    if not detail:
        with contextlib.suppress(ValueError, AttributeError):
            detail = str(response.json().get("error", ""))
    said = f"HTTP {code} for {what}" + (f" ({detail})" if detail else "")
    if code in (401, 403):
        hint = (
            "the token was rejected or lacks access: check it, and accept the model's license on its Hub "
            "page if the repository is gated"
            if token
            else "set HF_TOKEN or --token-file (gated and private repositories need a token; the Hub also "
            "answers 401 for a repository that does not exist)"
        )
        return DownloadError(ExitCode.AUTH, f"{said}: {hint}")
    if code == 404:
        return DownloadError(ExitCode.NOT_FOUND, f"{said}: check the repository {repo!r} and the revision")
    if code == 429 or code >= 500:
        return TransientError(said)
    return DownloadError(ExitCode.FAILED, said)


class HubSource:
    """Lists and streams the files of one repository at one revision."""

    def __init__(self, location: HubLocation, revision: str, token: str | None, client: httpx.Client) -> None:
        self.location = location
        self.revision = revision
        self.endpoint = hub_endpoint()
        self._token = token
        self._client = client
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.commit: str | None = None

    @property
    def gguf(self) -> str | None:
        return self.location.gguf

    def describe(self) -> str:
        return f"hf://{self.location.repo}@{self.revision}" + (
            f" ({self.endpoint})" if self.endpoint != DEFAULT_ENDPOINT else ""
        )

    def files(self) -> list[RemoteFile]:
        repo = self.location.repo
        url = f"{self.endpoint}/api/models/{repo}/revision/{quote(self.revision, safe='')}"
        try:
            response = self._client.get(url, params={"blobs": "true"}, headers=self._headers)
        except httpx.TransportError as error:
            raise TransientError(f"{url}: {error!r}") from None
        if response.status_code != 200:
            raise _hub_error(response, f"the metadata of {repo}@{self.revision}", self._token, repo)
        info: dict[str, Any] = response.json()
        self.commit = info.get("sha") or self.revision
        return [_remote_file(s) for s in info.get("siblings") or []]

    @contextlib.contextmanager
    def stream(self, file: RemoteFile, offset: int) -> Iterator[tuple[int, Iterator[bytes]]]:
        """(where the body starts: `offset` when the server honoured the Range, else 0; the body's chunks)."""
        url = (
            f"{self.endpoint}/{self.location.repo}/resolve/{self.commit or self.revision}/{quote(file.name)}"
        )
        headers = dict(self._headers)
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            with self._client.stream("GET", url, headers=headers) as response:
                if response.status_code == 416 and offset:  # the part file already holds everything
                    yield offset, iter(())
                    return
                if response.status_code not in (200, 206):
                    response.read()
                    raise _hub_error(response, file.name, self._token, self.location.repo)
                start = offset if response.status_code == 206 else 0
                yield start, response.iter_bytes()  # as received: a drop loses nothing
        except httpx.TransportError as error:  # also raised while the body is read
            raise TransientError(f"{file.name}: {error!r}") from None


def _remote_file(sibling: dict[str, Any]) -> RemoteFile:
    lfs = sibling.get("lfs") or {}
    size = sibling.get("size", lfs.get("size"))
    return RemoteFile(
        name=str(sibling["rfilename"]),
        size=int(size) if size is not None else None,
        sha256=lfs.get("sha256"),
        git_sha1=None if lfs else sibling.get("blobId"),
    )
