"""An engine with an FP8 KV cache (`kv_cache_dtype="fp8"`): twice the blocks of bfloat16 in the same
bytes, its caches written by the float8 rule, and the same model scores a prompt nearly as with its own
dtype's cache (the paths' accuracy is checked in attention/test_fp8_kv_cache.py; the real model's
perplexity in benchmarks/kv_cache_perplexity.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.engine import runner
from inflight.engine.attention.kv_store import FP8_DTYPE, to_cache
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.sequence import PositionLogprobs


def test_the_pool_holds_twice_the_blocks_of_bfloat16_in_the_same_bytes(tiny_llama_dir: Path) -> None:
    blocks = {}
    for kv_cache_dtype in ("auto", "fp8"):
        config = EngineConfig(
            device="cpu", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gib=2**-10
        )
        engine = LLMEngine(tiny_llama_dir, config)
        k_cache, v_cache = engine.runner.kv_caches[0]
        assert (
            k_cache.dtype
            == v_cache.dtype
            == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16)
        )
        assert k_cache.shape[0] == engine.num_kv_blocks
        blocks[kv_cache_dtype] = engine.num_kv_blocks
        engine.close()
    # tiny: 4 layers x 2 KV heads x 32 dims, K and V, 16 tokens: 16 KiB a bfloat16 block in 1 MiB.
    assert blocks == {"auto": 64, "fp8": 128}


def prompt_nll(entries: list[PositionLogprobs | None] | None, prompt: list[int]) -> float:
    """Mean negative log-likelihood of the prompt's tokens after the first."""
    assert entries is not None
    return -sum(
        entry[token].logprob for entry, token in zip(entries[1:], prompt[1:], strict=True) if entry
    ) / (len(prompt) - 1)


def test_an_fp8_kv_engine_generates_and_scores_like_its_dtype(tiny_llama_dir: Path) -> None:
    prompt = [(37 * i + 11) % 2000 for i in range(150)]  # nine blocks of 16 and a partial one
    # One token: the caches then hold the prompt's K/V only (the sampled token's are never written).
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    results, first_layer = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(
            tiny_llama_dir, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64
        )
        [scored] = llm.generate([prompt], score)
        results[kv_cache_dtype] = prompt_nll(scored.prompt_logprobs, prompt)
        first_layer[kv_cache_dtype] = [cache.clone() for cache in llm.engine.runner.kv_caches[0]]
        [output] = llm.generate(
            [prompt[:20]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        assert len(output.outputs[0].token_ids) == 12
        llm.close()
    # The first layer's K/V depend on the tokens alone: the FP8 engine stored exactly kv_store's bytes of
    # what the float32 engine stored (in the same blocks: allocation is deterministic).
    for fp8, float32 in zip(first_layer["fp8"], first_layer["auto"], strict=True):
        assert torch.equal(fp8.view(torch.uint8), to_cache(float32, FP8_DTYPE).view(torch.uint8))
    assert math.isfinite(results["fp8"])
    assert abs(results["fp8"] - results["auto"]) <= 0.01 * results["auto"]


def test_forked_sequences_copy_float8_blocks_on_write(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n > 1 shares the prompt's blocks; the first write into the shared partial block copies it
    (runner.copy_blocks), which must work for float8 caches too: the copy equals its source."""
    copied: list[tuple[int, int]] = []
    real_copy = runner.copy_blocks

    def copy_and_check(
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        copies: list[tuple[int, int]],
        device: torch.device,
    ) -> None:
        real_copy(kv_caches, copies, device)
        for src, dst in copies:
            for cache in kv_caches[0]:
                assert torch.equal(cache[dst].view(torch.uint8), cache[src].view(torch.uint8))
        copied.extend(copies)

    monkeypatch.setattr(runner, "copy_blocks", copy_and_check)
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=3, ignore_eos=True)
    [output] = llm.generate([list(range(1, 24))], params)  # 23 tokens: a partial second block
    llm.close()
    assert [len(sample.token_ids) for sample in output.outputs] == [20, 20, 20]
    assert copied  # the shared partial block was copied for the forks
