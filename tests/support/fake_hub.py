"""A fake Hugging Face Hub on 127.0.0.1: the metadata API, resolve URLs with Range, and failure knobs.

- `GET /api/models/{repo}/revision/{rev}?blobs=true`: the commit and siblings (size; lfs.sha256 for
  weights, blobId = git blob sha1 for small files), as the Hub answers.
- `GET /{repo}/resolve/{rev}/{file}`: small files directly; weights through a 302 to `/cdn/...` as the
  Hub's CDN redirect; `Range: bytes=N-` answered with 206.
- Gated repos answer 401 without the right Bearer token; unknown repos, revisions and files 404.
- Knobs: `drop_once[name] = n` sends n bytes of the file then drops the connection (once);
  `block_at = (name, n)` sends n bytes then waits for `release` before dropping the connection;
  `always_fail = status` answers every file request with it; `ignore_range` answers Ranges with 200.
Every file request is logged as (file name, Range header).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".onnx")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None  # gated: this Bearer token is required
    wrong_sha256: set[str] = field(default_factory=set)  # metadata lies about these files

    def siblings(self) -> list[dict[str, Any]]:
        out = []
        for name, data in sorted(self.files.items()):
            entry: dict[str, Any] = {"rfilename": name, "size": len(data)}
            if name.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                if name in self.wrong_sha256:
                    sha = hashlib.sha256(data + b"x").hexdigest()
                entry["blobId"] = git_blob_sha1(b"pointer " + name.encode())
                entry["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            else:
                entry["blobId"] = git_blob_sha1(data)
            out.append(entry)
        return out


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.drop_once: dict[str, int] = {}
        self.block_at: tuple[str, int] | None = None
        self.release = threading.Event()
        self.always_fail: int | None = None
        self.ignore_range = False  # answer Range requests with the whole file (200), as some mirrors do
        self.url = ""

    def ranges(self, name: str) -> list[str | None]:
        return [r for n, r in self.requests if n == name]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self._reply(status, body, {"X-Error-Code": code, "Content-Type": "application/json"})

        def _repo(self, name: str) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                return None
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "GatedRepo", "Access to model is restricted. You must be authenticated.")
                return None
            return repo

        def do_GET(self) -> None:
            path = unquote(urlparse(self.path).path)
            if match := re.fullmatch(r"/api/models/(.+)/revision/([^/]+)", path):
                repo = self._repo(match.group(1))
                if repo is None:
                    return
                if match.group(2) not in ("main", repo.commit):
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {match.group(2)}")
                    return
                info = {"id": match.group(1), "sha": repo.commit, "siblings": repo.siblings()}
                self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
            elif match := re.fullmatch(r"/cdn/(.+)/([0-9a-f]{40})/(.+)", path):
                self._file(hub.repos[match.group(1)], match.group(3))
            elif match := re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", path):
                repo = self._repo(match.group(1))
                if repo is None:
                    return
                name = match.group(3)
                if match.group(2) not in ("main", repo.commit) or name not in repo.files:
                    self._error(404, "EntryNotFound", f"{name} does not exist at {match.group(2)}")
                elif name.endswith(LFS_SUFFIXES):  # the Hub sends large files through its CDN
                    location = f"{hub.url}/cdn/{match.group(1)}/{repo.commit}/{name}"
                    self._reply(302, b"", {"Location": location})
                else:
                    self._file(repo, name)
            else:
                self._error(404, "NotFound", path)

        def _file(self, repo: Repo, name: str) -> None:
            hub.requests.append((name, self.headers.get("Range")))
            if hub.always_fail is not None:
                self._error(hub.always_fail, "Unavailable", "try again later")
                return
            data = repo.files[name]
            start = 0
            header = self.headers.get("Range")
            if header and not hub.ignore_range and (m := re.fullmatch(r"bytes=(\d+)-", header)):
                start = int(m.group(1))
                if start >= len(data):
                    self._reply(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut = hub.drop_once.pop(name, None)
            if hub.block_at is not None and hub.block_at[0] == name:
                cut = hub.block_at[1] - start
                self.wfile.write(body[:cut])
                self.wfile.flush()
                hub.release.wait(60)
                self.close_connection = True
                return
            if cut is not None:
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@contextmanager
def serve_hub(hub: FakeHub) -> Iterator[FakeHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.release.set()
        server.shutdown()
        server.server_close()
