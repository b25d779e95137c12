"""Which files of a checkpoint the engine needs, and what the source says about each (size, checksums)."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from inflight.download.errors import DownloadError, ExitCode

# Small files the engine reads besides the weights (config, generation defaults, tokenizer, chat template).
SUPPORT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class RemoteFile:
    """One file at the source: its path there, and the size and checksums the source publishes."""

    name: str
    size: int | None = None
    sha256: str | None = None  # the Hub's lfs.sha256 (large files)
    git_sha1: str | None = None  # the Hub's blobId of a file stored in git itself (small files)


def _top_level(files: list[RemoteFile]) -> dict[str, RemoteFile]:
    return {f.name: f for f in files if "/" not in f.name}


def select_support_files(files: list[RemoteFile], gguf: str | None) -> list[RemoteFile]:
    """The small files to fetch first; the safetensors index among them when the weights are sharded.

    Raises DownloadError (USAGE) when the source holds no weights the engine loads, and (NOT_FOUND)
    when the named GGUF file is not there.
    """
    top = _top_level(files)
    if gguf is not None:
        if gguf not in top:
            found = sorted(n for n in top if n.endswith(".gguf"))
            raise DownloadError(
                ExitCode.NOT_FOUND, f"no file {gguf!r} at the source; GGUF files there: {found or 'none'}"
            )
        return []
    weights = [n for n in top if n.endswith(".safetensors")]
    if not weights:
        ggufs = sorted(n for n in top if n.endswith(".gguf"))
        if ggufs:
            raise DownloadError(
                ExitCode.USAGE,
                f"the source holds GGUF files only; name one as the source's last path part "
                f"(e.g. .../{ggufs[0]}); found: {', '.join(ggufs)}",
            )
        other = sorted(n for n in top if fnmatch.fnmatch(n, "*.bin") or fnmatch.fnmatch(n, "*.pth"))
        raise DownloadError(
            ExitCode.USAGE,
            "the source has no *.safetensors or *.gguf weights at its top level"
            + (f" (found {', '.join(other)}: pickled weights are not loaded; convert them)" if other else ""),
        )
    names = [n for n in SUPPORT_FILES if n in top]
    if SAFETENSORS_INDEX in top:
        names.append(SAFETENSORS_INDEX)
    if "config.json" not in names:
        raise DownloadError(ExitCode.USAGE, "the source has safetensors weights but no config.json")
    return [top[n] for n in names]


def select_weights(files: list[RemoteFile], gguf: str | None, dest: Path) -> list[RemoteFile]:
    """The weight files: the named GGUF, the shards the downloaded index names, or every *.safetensors."""
    top = _top_level(files)
    if gguf is not None:
        return [top[gguf]]
    index = dest / SAFETENSORS_INDEX
    if SAFETENSORS_INDEX in top and index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as error:
            raise DownloadError(
                ExitCode.USAGE, f"{SAFETENSORS_INDEX} is not a valid index: {error}"
            ) from None
        missing = [s for s in shards if s not in top]
        if missing:
            raise DownloadError(
                ExitCode.NOT_FOUND, f"{SAFETENSORS_INDEX} names shards the source lacks: {missing}"
            )
        return [top[s] for s in shards]
    return [top[n] for n in sorted(top) if n.endswith(".safetensors")]
