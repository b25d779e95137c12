"""The real SmolLM2 GGUF, made once per checkout (in <repo>/.cache, like the tiny checkpoints) by the
same builtin:smollm2 maker the server uses, and transformers' GGUF-dequantized reference, loaded once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from inflight.builtin_models import builtin_model_path

    return builtin_model_path("smollm2", root=REPO_ROOT / ".cache")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> Any:
    """transformers' model for the same file (its own GGUF reader and dequantization), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
