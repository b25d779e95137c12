"""A model's logits for one sequence through a paged KV cache with shuffled blocks (the GGUF tests)."""

from __future__ import annotations

import random

import torch

from inflight.engine.attention.metadata import AttentionMetadata
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.runner import allocate_kv_caches

PAGED_BLOCK_SIZE = 8


def paged_logits(
    model: LlamaForCausalLM, chunks: list[list[int]], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits for one sequence fed as `chunks` (a prefill, then smaller steps) through a paged KV cache
    with shuffled blocks, in the model's `dtype`."""
    num_blocks = 64
    caches = allocate_kv_caches(model.config, num_blocks, PAGED_BLOCK_SIZE, dtype, "cpu")
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
