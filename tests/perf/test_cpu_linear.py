"""oneDNN-prepacked Linear layers: same results as nn.Linear, swapped in only where they apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from inflight.engine.cpu import linear as cpu_linear
from inflight.engine.cpu.isa import CpuIsa, cpu_isa
from inflight.engine.cpu.linear import PrepackedLinear, can_prepack, prepack_linears, warm_batch_sizes

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


def test_every_distinct_projection_shape_runs_once_at_each_decode_batch_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """oneDNN builds a GEMM primitive per shape and batch size, the first time it meets them; the warm-up
    meets each before a request does, once (layers of the same shape share the primitive)."""
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Linear(8, 16, bias=False), nn.Linear(16, 8)
    )
    prepack_linears(model, batch_size_hint=4)
    calls: list[tuple[int, int, bool, int]] = []
    forward = PrepackedLinear.forward

    def record(self: PrepackedLinear, x: torch.Tensor) -> torch.Tensor:
        calls.append((self.out_features, self.in_features, self.bias is None, x.shape[0]))
        return forward(self, x)

    monkeypatch.setattr(PrepackedLinear, "forward", record)
    assert warm_batch_sizes(model, max_batch_size=4) == 4
    shapes = {(16, 8, False), (8, 16, False), (16, 8, True)}
    assert sorted(calls) == sorted((*shape, rows) for shape in shapes for rows in range(1, 5))
    # At most half of oneDNN's primitive cache: 3 shapes x 2 sizes of a 12-entry cache.
    calls.clear()
    monkeypatch.setattr(cpu_linear, "PRIMITIVE_CACHE_ENTRIES", 12)
    assert warm_batch_sizes(model, max_batch_size=64) == 2
    assert max(rows for *_, rows in calls) == 2
    assert warm_batch_sizes(nn.Sequential(nn.ReLU()), max_batch_size=64) == 0


def test_the_engine_warms_its_slots_batch_sizes(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    from inflight import LLM

    warmed: list[int] = []
    monkeypatch.setattr(cpu_linear, "warm_batch_sizes", lambda model, size: warmed.append(size) or size)
    LLM(tiny_llama_dir, max_slots=3, num_kv_blocks=64, dtype="float32")
    assert warmed == [3]


@pytest.mark.parametrize("native", [False, True])
def test_float32_on_cpu_and_bfloat16_only_where_native(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    isa = CpuIsa(name="test CPU", avx512_bf16=native, amx_bf16=False)
    monkeypatch.setattr(cpu_linear, "cpu_isa", lambda: isa)
    assert can_prepack(torch.device("cpu"), torch.float32)
    assert can_prepack(torch.device("cpu"), torch.bfloat16) == native
    assert not can_prepack(torch.device("cpu"), torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)
    assert not can_prepack(torch.device("cuda"), torch.bfloat16)


@pytest.mark.skipif(not cpu_isa().native_bfloat16, reason="bfloat16 is not native on this CPU: not prepacked")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_prepacked_bfloat16_linear_within_rounding_of_nn_linear(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 80).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    actual = PrepackedLinear(linear, batch_size_hint=64)(x)
    assert actual.dtype == torch.bfloat16
    # float32 accumulation, one bfloat16 rounding of the result (2^-8 relative).
    torch.testing.assert_close(actual.double(), exact, rtol=2**-8, atol=1e-3)


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
