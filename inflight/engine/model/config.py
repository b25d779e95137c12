"""ModelConfig: the shape of a Llama-family checkpoint, parsed from its Hugging Face `config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from inflight.engine.dtypes import DTYPE_NAMES, DTypeName
from inflight.engine.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RopeScaling(BaseModel):
    """RoPE frequency scaling. `llama3` (Llama 3.1+) and `linear` are supported."""

    model_config = ConfigDict(frozen=True)

    rope_type: Literal["linear", "llama3"]
    factor: float
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


class ModelConfig(BaseModel):
    """Everything the model, the KV cache and the sizing code need to know about a checkpoint."""

    model_config = ConfigDict(frozen=True)

    architecture: Literal["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Bias on the q/k/v projections (Qwen2; Llama with attention_bias=true).
    attention_bias: bool = False
    # Bias on the output projection (Llama with attention_bias=true; never Qwen2).
    o_proj_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = []
    torch_dtype: DTypeName = "float32"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path}: not found. A model folder is a Hugging Face checkpoint (config.json, "
                "*.safetensors, tokenizer files); make a local one with `inflight make-model --out DIR`."
            )
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(
                f"{path}: not valid JSON ({e}); restore the file from the checkpoint."
            ) from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}.")
        return cls.from_hf_dict(raw, source=str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict; raise ModelLoadError naming `source` on anything unsupported."""

        def fail(what: str) -> ModelLoadError:
            return ModelLoadError(f"{source}: {what}")

        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise fail(
                f"architecture {architectures or '(none given)'} is not supported; "
                f"inflight runs {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        activation = raw.get("hidden_act", "silu")
        if activation != "silu":
            raise fail(f"hidden_act {activation!r} is not supported; only 'silu' (SwiGLU) is.")
        if raw.get("mlp_bias"):
            raise fail("mlp_bias=true is not supported.")

        try:
            hidden_size = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            fields: dict[str, Any] = {
                "architecture": architecture,
                "vocab_size": raw["vocab_size"],
                "hidden_size": hidden_size,
                "intermediate_size": raw["intermediate_size"],
                "num_hidden_layers": raw["num_hidden_layers"],
                "num_attention_heads": num_heads,
                "num_key_value_heads": raw.get("num_key_value_heads") or num_heads,
                "head_dim": raw.get("head_dim") or hidden_size // num_heads,
                "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
                "max_position_embeddings": raw.get("max_position_embeddings", 2048),
                "tie_word_embeddings": raw.get("tie_word_embeddings", False),
            }
        except KeyError as e:
            raise fail(f"required field {e.args[0]!r} is missing.") from e

        rope_theta, rope_scaling = _rope(raw, fail)
        fields["rope_theta"] = rope_theta
        fields["rope_scaling"] = rope_scaling

        if architecture == "Qwen2ForCausalLM":
            fields["attention_bias"] = True
            if raw.get("use_sliding_window"):
                raise fail(
                    "use_sliding_window=true (per-layer sliding window) is not supported for Qwen2; "
                    "set it to false."
                )
        else:
            bias = bool(raw.get("attention_bias", False))
            fields["attention_bias"] = bias
            fields["o_proj_bias"] = bias
        if architecture == "MistralForCausalLM":
            fields["sliding_window"] = raw.get("sliding_window")

        fields["bos_token_id"] = raw.get("bos_token_id")
        eos = raw.get("eos_token_id")
        fields["eos_token_id"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        fields["torch_dtype"] = dtype if dtype in DTYPE_NAMES else "float32"

        try:
            config = cls(**fields)
        except ValidationError as e:
            raise fail(f"invalid value: {e}") from e
        if config.num_attention_heads % config.num_key_value_heads:
            raise fail(
                f"num_attention_heads ({config.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})."
            )
        if config.head_dim % 2:
            raise fail(f"head_dim {config.head_dim} is odd; rotary embeddings need an even head_dim.")
        return config


def _rope(raw: dict[str, Any], fail: Any) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either the classic (`rope_theta` + `rope_scaling`) or the
    transformers-5 (`rope_parameters`) layout."""
    params = raw.get("rope_parameters")
    scaling = dict(params) if isinstance(params, dict) else dict(raw.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    partial = scaling.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise fail(f"partial_rotary_factor {partial} is not supported; rotary must cover the whole head.")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise fail(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if rope_type == "default":
        return theta, None
    try:
        fields = {k: v for k, v in scaling.items() if v is not None}
        return theta, RopeScaling.model_validate({"rope_type": rope_type, **fields})
    except (ValidationError, TypeError) as e:
        raise fail(f"invalid rope scaling {scaling}: {e}") from e
