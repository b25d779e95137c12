"""Tiny generated checkpoints, made once and cached on disk (the fixtures in tests/conftest.py use them).

Checkpoints live in `<repo>/.cache/models/<preset>-<arch>-<seed>-<fingerprint>`; the fingerprint covers
the generator's code and inputs, so a change to either makes a fresh one. Each is written to a private
temporary folder and renamed into place, so concurrent test runs never see a half-written model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = REPO_ROOT / ".cache" / "models"


def cached_model(preset: str, arch: str, seed: int = 0) -> Path:
    from inflight.checkpoints.make import fingerprint, make_model

    final = MODEL_CACHE / f"{preset}-{arch}-{seed}-{fingerprint(preset)}"
    if (final / "config.json").is_file():
        return final
    tmp = MODEL_CACHE / f".build-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make_model(tmp, preset=preset, arch=arch, seed=seed, progress=lambda _message: None)
    try:
        tmp.rename(final)
    except OSError:  # another test run finished the same model first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise
    return final


def truncated_model(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """A copy of a checkpoint folder with only its first `num_layers` decoder layers (same embeddings,
    head and tokenizer): a smaller model with the same vocabulary, for speculative decoding's draft."""
    import json

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json" and path.is_file():
            shutil.copy(path, out_dir / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                continue
            tensors[name] = tensor
    save_file(tensors, out_dir / "model.safetensors")
    return out_dir
