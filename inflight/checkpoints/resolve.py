"""`--model` to a local checkpoint: a folder, a .gguf file, or `builtin:NAME` (made once into the cache)."""

from __future__ import annotations

from pathlib import Path

from inflight.checkpoints.builtin import BUILTIN_PREFIX, BuiltinModelError, builtin_model_path
from inflight.engine.config import EngineConfig
from inflight.engine.gguf import is_gguf


def resolve_model(model: str, flag: str = "--model") -> Path:
    """The checkpoint for `--model` (or another flag naming one): a folder, a .gguf file, or
    `builtin:NAME` (made once into the cache dir, see inflight/checkpoints/builtin.py)."""
    if model.startswith(BUILTIN_PREFIX):
        try:
            return builtin_model_path(model)
        except BuiltinModelError as e:
            raise SystemExit(f"inflight: {flag} {model}: {e}") from e
    path = Path(model).expanduser()
    if is_gguf(path):
        return path
    if not path.is_dir():
        raise SystemExit(
            f"{flag} {model}: no such directory or .gguf file (or use builtin:smollm2 / builtin:tiny)"
        )
    if not (path / "config.json").is_file():
        raise SystemExit(f"{flag} {model}: no config.json there; expected a Hugging Face checkpoint")
    return path


def resolve_draft_model(config: EngineConfig) -> EngineConfig:
    """`config` with its `--draft-model` (speculative decoding's) resolved as `--model` is."""
    if config.draft_model is None:
        return config
    return config.model_copy(update={"draft_model": str(resolve_model(config.draft_model, "--draft-model"))})
