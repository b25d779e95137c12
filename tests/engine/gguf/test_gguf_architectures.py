"""Each architecture the engine runs, written as a GGUF file the way llama.cpp's converter writes it
(tensor names, q/k row permutation for llama/mistral, Llama 3.1 rope factors as rope_freqs.weight),
loads to the same config and the same logits as its Hugging Face checkpoint folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from inflight.engine.loader import load_model
from inflight.engine.model.config import ModelConfig

from support.gguf_files import write_gguf
from support.paged_model import paged_logits

PROMPT = [5, 77, 300, 12, 901, 4, 64, 1000, 33, 2, 150, 7, 8, 9, 1999, 40, 41, 42, 43, 44, 45, 46, 47]
CHUNKS = [PROMPT[:17], PROMPT[17:20], *([t] for t in PROMPT[20:])]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_gguf_loads_like_its_checkpoint_folder(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    gguf = write_gguf(model_dir, tmp_path / f"{arch}.gguf")
    expected_config = ModelConfig.from_dir(model_dir)
    ours = load_model(gguf)
    # Token ids are the tokenizer's business in a GGUF; eps and theta are stored as float32 there.
    ignored = {"bos_token_id", "eos_token_id", "torch_dtype", "rms_norm_eps", "rope_theta"}
    assert ours.config.model_dump(exclude=ignored) == expected_config.model_dump(exclude=ignored)
    assert ours.config.rms_norm_eps == pytest.approx(expected_config.rms_norm_eps, rel=1e-7)
    assert ours.config.rope_theta == pytest.approx(expected_config.rope_theta, rel=1e-7)
    reference = load_model(model_dir)
    torch.testing.assert_close(paged_logits(ours, CHUNKS), paged_logits(reference, CHUNKS), atol=1e-5, rtol=0)


def test_a_q8_0_gguf_runs_on_its_dequantized_weights(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    ours = load_model(write_gguf(tiny_qwen2_dir, tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0))
    reference = load_model(tiny_qwen2_dir)
    delta = paged_logits(ours, CHUNKS) - paged_logits(reference, CHUNKS)
    assert 0 < delta.abs().max().item() < 0.05  # quantization noise, not a wrong layout


def test_two_tensor_parallel_ranks_run_a_gguf_like_one_rank_runs_its_folder(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from inflight.engine.config import EngineConfig
    from inflight.engine.engine import LLMEngine
    from inflight.engine.sequence import SamplingParams

    gguf = write_gguf(tiny_llama_dir, tmp_path / "llama.gguf", tokenizer=True)
    prompts = [PROMPT, PROMPT[3:11], [9, 8, 7, 6, 5]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(model: Path, tp: int) -> list[list[int]]:
        config = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=32, tensor_parallel_size=tp)
        engine = LLMEngine(model, config)
        try:
            return [output.outputs[0].token_ids for output in engine.generate(prompts, params)]
        finally:
            engine.close()

    assert run(gguf, 2) == run(tiny_llama_dir, 1)
