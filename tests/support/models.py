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
