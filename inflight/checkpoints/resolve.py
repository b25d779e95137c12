"""`--model` to a local checkpoint: a folder, a .gguf file, or `builtin:NAME` (made once into the cache)."""

from __future__ import annotations

from pathlib import Path

from inflight.checkpoints.builtin import BUILTIN_PREFIX, BuiltinModelError, builtin_model_path
from inflight.engine.gguf import is_gguf


def resolve_model(model: str) -> Path:
    """The checkpoint for `--model`: a folder, a .gguf file, or `builtin:NAME` (made once into the cache
    dir, see inflight/checkpoints/builtin.py)."""
    if model.startswith(BUILTIN_PREFIX):
        try:
            return builtin_model_path(model)
        except BuiltinModelError as e:
            raise SystemExit(f"inflight: --model {model}: {e}") from e
    path = Path(model).expanduser()
    if is_gguf(path):
        return path
    if not path.is_dir():
        raise SystemExit(
            f"--model {model}: no such directory or .gguf file (or use builtin:smollm2 / builtin:tiny)"
        )
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there; expected a Hugging Face checkpoint")
    return path
