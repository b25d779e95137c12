"""The real SmolLM2-135M-Instruct Q4_1 file kept quantized (the default, `quantization="auto"`: Q4_1
projections and the Q8_0 embedding / LM head in their blocks) against transformers' GGUF-dequantized
float32 model. Single-row decode steps take the AVX-512 VNNI kernel where the CPU has it, which rounds
the activations to int8 per 32-block (as llama.cpp does); so the logits are not those of the dequantized
weights to 1e-4 but close: measured mean |error| 0.023 and worst 0.79 (logit scale ~38) over a 38-token
chat prompt, less than the dequantized model's own bfloat16 error (mean 0.17), and the same argmax at
every position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inflight.engine.cpu.quantized import QuantizedEmbedding, QuantizedLinear
from inflight.engine.loader import load_model

from support.paged_model import paged_logits

MEAN_ERROR = 0.05


def test_kept_quantized_logits_are_close_to_the_dequantized_models(
    smollm2_gguf: Path, hf_smollm2: Any
) -> None:
    ours = load_model(smollm2_gguf, torch.float32)
    assert sum(isinstance(m, QuantizedLinear) for m in ours.modules()) == 4 * 30
    assert isinstance(ours.embed_tokens, QuantizedEmbedding) and ours.lm_head is None
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]
    ids += [19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531]
    with torch.inference_mode():
        expected = hf_smollm2(torch.tensor([ids])).logits[0]
    got = paged_logits(ours, [ids[:21], ids[21:30], *([t] for t in ids[30:])])
    assert (got - expected).abs().mean().item() < MEAN_ERROR
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
