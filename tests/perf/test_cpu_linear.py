"""oneDNN-prepacked Linear layers: same results as nn.Linear, swapped in only where they apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from inflight.engine.cpu.linear import PrepackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_linear_equals_nn_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias)
    x = torch.randn(rows, 96)
    expected = linear(x)
    actual = PrepackedLinear(linear, batch_size_hint=64)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_prepack_replaces_every_linear_and_keeps_parameters() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    names_before = dict(model.named_parameters())
    assert prepack_linears(model, batch_size_hint=4) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert dict(model.named_parameters()) == names_before


def test_only_float32_on_cpu() -> None:
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)
    assert not can_prepack(torch.device("cuda"), torch.float32)


def test_engine_prepacks_on_cpu_and_still_matches_unpacked_greedy(tiny_llama_dir: Path) -> None:
    from inflight import LLM, SamplingParams
    from inflight.engine.loader import load_model

    llm = LLM(tiny_llama_dir, max_slots=4, num_kv_blocks=64, dtype="float32")
    assert any(isinstance(m, PrepackedLinear) for m in llm.engine.model.modules())
    # The same prompts through an engine whose model was not prepacked.
    plain = LLM(tiny_llama_dir, max_slots=4, num_kv_blocks=64, dtype="float32")
    plain.engine.model = plain.engine.runner.model = load_model(
        tiny_llama_dir, torch.float32, torch.device("cpu")
    )
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    packed_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    plain_tokens = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert packed_tokens == plain_tokens


def test_tied_lm_head_is_prepacked_over_the_shared_embedding() -> None:
    from inflight.engine.attention.backend import get_attention_backend
    from inflight.engine.model.config import ModelConfig
    from inflight.engine.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "max_position_embeddings": 64,
            "tie_word_embeddings": True,
        }
    )
    cpu = torch.device("cpu")
    model = LlamaForCausalLM(config, get_attention_backend(cpu), cpu)
    hidden = torch.randn(9, 64)
    expected = model.compute_logits(hidden)
    parameters_before = dict(model.named_parameters())
    prepack_linears(model, batch_size_hint=8)
    assert isinstance(model.lm_head, PrepackedLinear)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert dict(model.named_parameters()) == parameters_before
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)
