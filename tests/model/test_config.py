"""ModelConfig parses the config.json of well-known checkpoints (the fields as their authors publish them)."""

from __future__ import annotations

from typing import Any

import pytest

from inflight.engine.model.config import ModelConfig
from inflight.engine.model.errors import ModelLoadError

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}
MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}


def test_llama_31() -> None:
    config = ModelConfig.from_hf_dict(LLAMA_31_8B)
    assert config.head_dim == 128 and config.num_queries_per_kv == 4
    assert config.eos_token_id == [128001, 128008, 128009]
    assert config.rope_scaling is not None
    assert (
        config.rope_scaling.rope_type == "llama3"
        and config.rope_scaling.original_max_position_embeddings == 8192
    )
    assert not config.attention_bias and config.sliding_window is None and config.torch_dtype == "bfloat16"


def test_qwen25_has_qkv_bias_and_no_window() -> None:
    config = ModelConfig.from_hf_dict(QWEN25_7B)
    assert config.attention_bias and not config.o_proj_bias
    assert config.sliding_window is None  # use_sliding_window is false
    assert config.eos_token_id == [151645] and config.head_dim == 128


def test_mistral_window() -> None:
    config = ModelConfig.from_hf_dict(MISTRAL_7B_V01)
    assert config.sliding_window == 4096 and config.rope_scaling is None
    assert ModelConfig.from_hf_dict({**MISTRAL_7B_V01, "sliding_window": None}).sliding_window is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, "not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_size": None}, "hidden_size"),
        ({"vocab_size": "many"}, "invalid value"),
    ],
)
def test_unsupported_or_broken_configs_say_what_is_wrong(change: dict[str, Any], message: str) -> None:
    raw = {k: v for k, v in {**QWEN25_7B, **change}.items() if v is not None}
    with pytest.raises(ModelLoadError, match=message) as info:
        ModelConfig.from_hf_dict(raw, source="/models/x/config.json")
    assert str(info.value).startswith("/models/x/config.json: ")


def test_llama3_rope_frequencies_equal_transformers() -> None:
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from inflight.engine.model.llama import rope_inv_freq

    fields = {k: v for k, v in LLAMA_31_8B.items() if k not in ("architectures", "model_type")}
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**fields), torch.device("cpu"))
    ours = rope_inv_freq(ModelConfig.from_hf_dict(LLAMA_31_8B), torch.device("cpu"))
    assert torch.equal(ours, expected)
    plain = rope_inv_freq(
        ModelConfig.from_hf_dict({**LLAMA_31_8B, "rope_scaling": None}), torch.device("cpu")
    )
    assert not torch.equal(plain, expected)  # the scaling changed the low frequencies
