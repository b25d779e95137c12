"""transformers' GGUF-dequantized reference for the real SmolLM2 GGUF (the `smollm2_gguf` fixture of
tests/conftest.py), loaded once per session, and `paged_logits`, a model's logits through a paged KV
cache."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.model.llama import LlamaForCausalLM, allocate_kv_caches

PAGED_BLOCK_SIZE = 8


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


def paged_logits(model: LlamaForCausalLM, chunks: list[list[int]]) -> torch.Tensor:
    """Logits for one sequence fed as `chunks` (a prefill, then smaller steps) through a paged KV cache
    with shuffled blocks."""
    num_blocks = 64
    caches = allocate_kv_caches(model.config, num_blocks, PAGED_BLOCK_SIZE, torch.float32, "cpu")
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    table: list[int] = []
    rows = []
    done = 0
    for chunk in chunks:
        end = done + len(chunk)
        while len(table) * PAGED_BLOCK_SIZE < end:
            table.append(free.pop())
        positions = list(range(done, end))
        slots = [table[p // PAGED_BLOCK_SIZE] * PAGED_BLOCK_SIZE + p % PAGED_BLOCK_SIZE for p in positions]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0, len(chunk)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([table], dtype=torch.int32),
            query_lens_list=[len(chunk)],
            seq_lens_list=[end],
            max_query_len=len(chunk),
            max_seq_len=end,
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(chunk), torch.tensor(positions), caches, meta)
            rows.append(model.compute_logits(hidden))
        done = end
    return torch.cat(rows)
