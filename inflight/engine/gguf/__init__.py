"""GGUF checkpoints (llama.cpp's single-file format): config, weights, tokenizer in one file."""

from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """True for an existing file named *.gguf (a model path that is not a checkpoint folder)."""
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()
