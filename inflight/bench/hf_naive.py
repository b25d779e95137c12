"""transformers `generate`, one request at a time: what serving without batching gets."""

from __future__ import annotations

import time

from inflight.bench.hf_common import NO_EOS, WARMUP_TOKENS, load_model, pad_token_id, transformers_missing
from inflight.bench.system import BenchSettings, System, SystemRun


def run(settings: BenchSettings) -> SystemRun:
    import torch

    start = time.perf_counter()
    model = load_model(settings)
    pad = pad_token_id(model)

    def generate(prompt: list[int], n: int) -> list[int]:
        input_ids = torch.tensor([prompt])
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=NO_EOS,
            pad_token_id=pad,
        )
        return [int(t) for t in output[0, len(prompt) :]]

    with torch.inference_mode():
        generate(settings.requests[0].prompt_token_ids, WARMUP_TOKENS)
        setup = time.perf_counter() - start
        start = time.perf_counter()
        outputs = [generate(r.prompt_token_ids, r.output_len) for r in settings.requests]
        seconds = time.perf_counter() - start
    return SystemRun(outputs, seconds, setup, {"batch_size": 1})


SYSTEM = System(
    name="hf-naive",
    description="transformers generate, one request at a time",
    unavailable=transformers_missing,
    run=run,
)
