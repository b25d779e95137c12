"""transformers `generate` on padded batches: static batching without a paged cache."""

from __future__ import annotations

import time

from inflight.bench.hf_common import NO_EOS, WARMUP_TOKENS, load_model, pad_token_id, transformers_missing
from inflight.bench.system import BenchSettings, System, SystemRun


def run(settings: BenchSettings) -> SystemRun:
    import torch

    start = time.perf_counter()
    model = load_model(settings)
    pad = pad_token_id(model)

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        """Left-padded batch; every row runs to the longest length and is cut to its own."""
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(lengths)
        output = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=longest,
            eos_token_id=NO_EOS,
            pad_token_id=pad,
        )
        return [[int(t) for t in row[width : width + n]] for row, n in zip(output, lengths, strict=True)]

    batch_size = settings.max_slots
    with torch.inference_mode():
        generate([settings.requests[0].prompt_token_ids] * 2, [WARMUP_TOKENS] * 2)
        setup = time.perf_counter() - start
        start = time.perf_counter()
        outputs: list[list[int]] = []
        for first in range(0, len(settings.requests), batch_size):
            batch = settings.requests[first : first + batch_size]
            outputs += generate([r.prompt_token_ids for r in batch], [r.output_len for r in batch])
        seconds = time.perf_counter() - start
    return SystemRun(outputs, seconds, setup, {"batch_size": batch_size, "padding": "left"})


SYSTEM = System(
    name="hf-static",
    description="transformers generate on padded batches of max_slots requests",
    unavailable=transformers_missing,
    run=run,
)
