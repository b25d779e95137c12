"""Loading the checkpoint into transformers, shared by the three transformers baselines."""

from __future__ import annotations

import importlib.util
from typing import Any

from inflight.bench.system import BenchSettings

WARMUP_TOKENS = 4
# generate's end-of-sequence id for the baselines: none, so that EOS is an ordinary token and every request
# runs to exactly its length, as `ignore_eos` makes it for vLLM and inflight. (min_new_tokens would instead
# forbid EOS until then: a different next token wherever the model ranks EOS first.)
NO_EOS = None


def transformers_missing(settings: BenchSettings) -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install 'inflight[dev]')"
    return None


def load_model(settings: BenchSettings) -> Any:
    """The checkpoint as a transformers model in eval mode, SDPA attention, the benchmark's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        settings.model_dir, dtype=getattr(torch, settings.dtype), attn_implementation="sdpa"
    )
    return model.eval()


def pad_token_id(model: Any) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return int(pad) if pad is not None else 0
