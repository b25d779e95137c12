"""A GGUF file (llama.cpp's single-file checkpoint) as the engine needs it: a ModelConfig from the
metadata and the weights under their Hugging Face names, dequantized or (those asked for) kept in their
blocks (engine/cpu/quantized.py), with q/k rows in HF order.

The `gguf` package reads the file (memory-mapped, so only one dequantized tensor is in memory beside
the model at a time).
"""

from __future__ import annotations

import logging
import mmap
import re
import time
from collections import Counter
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from inflight.engine.cpu.quantized import QuantizedTensor
from inflight.engine.gguf.dequant import SUPPORTED_TYPES, dequantize, supported_type_names
from inflight.engine.gguf.repack import from_gguf_blocks
from inflight.engine.model.config import ModelConfig, RopeScaling
from inflight.engine.model.errors import ModelLoadError
from inflight.engine.model.llama import rope_inv_freq

# general.architecture -> the Hugging Face architecture the engine runs it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
# llama.cpp stores Q and K of these rotated-pair ("normal" rope) architectures with rows permuted.
PERMUTED_QK_ARCHITECTURES = ("llama", "mistral")

logger = logging.getLogger("inflight.engine")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3.1-style rope scaling as llama.cpp stores it: one factor per rotary frequency.
ROPE_FREQS = "rope_freqs.weight"
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf.py `LlamaModel.permute`): per head, the file
    interleaves the two rotary halves; Hugging Face keeps them as two contiguous halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """One opened GGUF file. Raises ModelLoadError naming the file for anything unreadable or unsupported."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        start = time.perf_counter()
        try:
            self._reader = GGUFReader(self.path)
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({e}); download it again.") from e
        self.metadata: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if field.types and field.types[0] == GGUFValueType.ARRAY and name.startswith("tokenizer.ggml."):
                continue  # the big vocabulary arrays: read on demand by `array`
            self.metadata[name] = field.contents()
        self.gguf_architecture = str(self.metadata.get("general.architecture", "(none)"))
        types = Counter(t.tensor_type.name for t in self._reader.tensors)
        logger.info(
            "GGUF %s: %s, %d tensors (%s), metadata read in %.1fs",
            self.path.name,
            self.gguf_architecture,
            len(self._reader.tensors),
            ", ".join(f"{count} {name}" for name, count in types.most_common()),
            time.perf_counter() - start,
        )

    def array(self, name: str) -> list[Any] | None:
        field = self._reader.fields.get(name)
        if field is None:
            return None
        values = field.contents()
        return list(values) if values is not None else None

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {what}")

    def _arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.gguf_architecture}.{key}", default)

    def config(self) -> ModelConfig:
        arch = self.gguf_architecture
        if arch not in GGUF_ARCHITECTURES:
            raise self.fail(
                f"GGUF architecture {arch!r} is not supported; inflight runs {', '.join(GGUF_ARCHITECTURES)}."
            )
        experts = self._arch_value("expert_count") or 0
        if experts > 0:
            raise self.fail(
                f"a mixture-of-experts model ({arch}.expert_count={experts}) is not supported; "
                "inflight has no MoE layer."
            )
        names = {t.name for t in self._reader.tensors}
        unsupported = sorted(
            {t.tensor_type.name for t in self._reader.tensors} - {t.name for t in SUPPORTED_TYPES}
        )
        if unsupported:
            raise self.fail(
                f"GGUF tensor type(s) {', '.join(unsupported)} not supported; inflight reads "
                f"{supported_type_names()}."
            )
        try:
            hidden = int(self._arch_value("embedding_length"))
            heads = int(self._arch_value("attention.head_count"))
            raw: dict[str, Any] = {
                "architectures": [GGUF_ARCHITECTURES[arch]],
                "hidden_size": hidden,
                "intermediate_size": int(self._arch_value("feed_forward_length")),
                "num_hidden_layers": int(self._arch_value("block_count")),
                "num_attention_heads": heads,
            }
        except (TypeError, ValueError) as e:
            raise self.fail(f"metadata lacks the model's shape ({arch}.embedding_length, ...): {e}") from e
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        raw["vocab_size"] = self._arch_value("vocab_size") or (len(tokens.data) if tokens else None)
        if raw["vocab_size"] is None:
            raise self.fail(f"metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens (vocabulary size).")
        raw["num_key_value_heads"] = self._arch_value("attention.head_count_kv") or heads
        head_dim = self._arch_value("attention.key_length") or hidden // heads
        raw["head_dim"] = head_dim
        rotary = self._arch_value("rope.dimension_count") or head_dim
        if rotary != head_dim:
            raw["partial_rotary_factor"] = rotary / head_dim
        raw["rms_norm_eps"] = self._arch_value("attention.layer_norm_rms_epsilon", 1e-5)
        raw["rope_theta"] = self._arch_value("rope.freq_base", 10000.0)
        raw["max_position_embeddings"] = self._arch_value("context_length", 2048)
        scaling = self._arch_value("rope.scaling.type")
        if scaling not in (None, "none"):
            raw["rope_scaling"] = {"rope_type": scaling, "factor": self._arch_value("rope.scaling.factor")}
        raw["tie_word_embeddings"] = "output.weight" not in names
        raw["attention_bias"] = "blk.0.attn_q.bias" in names
        if arch == "mistral":
            raw["sliding_window"] = self._arch_value("attention.sliding_window")
        raw["bos_token_id"] = self.metadata.get("tokenizer.ggml.bos_token_id")
        raw["eos_token_id"] = self.metadata.get("tokenizer.ggml.eos_token_id")
        config = ModelConfig.from_hf_dict(raw, source=str(self.path))
        if ROPE_FREQS in names:
            config = config.model_copy(update={"rope_scaling": self._llama3_scaling(config)})
        return config

    def _llama3_scaling(self, config: ModelConfig) -> RopeScaling:
        """The Llama 3.1 rope scaling whose per-frequency factors llama.cpp stored as rope_freqs.weight.

        The file keeps only the factors; the parameters are found by trying the standard ones (low/high
        frequency factors 1 and 4, the original context a power of two) against them.
        """
        tensor = next(t for t in self._reader.tensors if t.name == ROPE_FREQS)
        factors = dequantize(
            np.asarray(tensor.data), int(tensor.tensor_type), (tensor.n_elements,), torch.float32
        )
        plain = rope_inv_freq(config, torch.device("cpu"))
        if factors.shape != plain.shape:
            raise self.fail(f"{ROPE_FREQS} has {factors.numel()} factors; head_dim {config.head_dim} needs "
                            f"{plain.numel()}.")  # fmt: skip
        contexts = sorted({config.max_position_embeddings, *(2**k for k in range(4, 21))})
        for context in contexts:
            scaling = RopeScaling(
                rope_type="llama3",
                factor=float(factors.max()),
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=context,
            )
            scaled = rope_inv_freq(config.model_copy(update={"rope_scaling": scaling}), torch.device("cpu"))
            if torch.allclose(plain / scaled, factors, rtol=1e-4):
                return scaling
        raise self.fail(
            f"the per-frequency rope factors in {ROPE_FREQS} match no Llama 3.1-style rope scaling "
            "(low/high frequency factors 1 and 4); load the Hugging Face checkpoint instead."
        )

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory once the weights are copied out: the
        memory map stays (the tokenizer may read its arrays again, faulting those pages back in), but the
        read weights no longer count twice in RSS (a 98 MB file: 94 MiB). Linux only; a no-op elsewhere."""
        mapping = getattr(self._reader.data, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mapping.madvise(mmap.MADV_DONTNEED)
            except OSError as e:  # never fatal: the pages only stay resident
                logger.debug("GGUF %s: madvise(DONTNEED) failed: %s", self.path.name, e)

    def tensor_types(self) -> dict[str, GGMLQuantizationType]:
        """Hugging Face name -> the GGUF type it is stored in, for every weight with a name."""
        types = {}
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                types[name] = GGMLQuantizationType(int(tensor.tensor_type))
        return types

    def tensors(
        self, config: ModelConfig, dtype: torch.dtype, keep: set[str] | frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """(Hugging Face name, tensor in `dtype`) for every weight, in file order, dequantized one at a time;
        the names in `keep` (of types in quantized.KEPT_GGUF_TYPES) as QuantizedTensors instead.

        Raises ModelLoadError naming the tensors the engine has no place for before reading any.
        """
        unknown = [t.name for t in self._reader.tensors if hf_name(t.name) is None and t.name != ROPE_FREQS]
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise self.fail(
                f"tensor(s) {shown} have no place in a {config.architecture}; the file holds a model "
                "variant inflight does not run."
            )
        permuted = self.gguf_architecture in PERMUTED_QK_ARCHITECTURES
        start = time.perf_counter()
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name)
            if name is None:  # rope_freqs.weight: read into the config's rope scaling
                continue
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            try:
                raw = np.asarray(tensor.data)
            except (OSError, ValueError) as e:
                raise self.fail(f"tensor {tensor.name!r} cannot be read ({e}); the file is truncated.") from e
            weight: torch.Tensor | QuantizedTensor
            try:
                if name in keep:
                    rows, cols = shape
                    weight = from_gguf_blocks(
                        raw, GGMLQuantizationType(int(tensor.tensor_type)), (rows, cols)
                    )
                else:
                    weight = dequantize(raw, int(tensor.tensor_type), shape, dtype)
            except (ModelLoadError, ValueError) as e:
                raise self.fail(f"tensor {tensor.name!r}: {e}") from e
            heads = {
                ".self_attn.q_proj.": config.num_attention_heads,
                ".self_attn.k_proj.": config.num_key_value_heads,
            }
            for part, count in heads.items():
                if permuted and part in name:
                    if isinstance(weight, QuantizedTensor):
                        order = unpermute_rows(torch.arange(weight.shape[0]), count)
                        weight = weight.permute_rows(order)
                    else:
                        weight = unpermute_rows(weight, count)
            yield name, weight
        self.release_pages()
        logger.info(
            "GGUF %s: weights read (%d kept quantized, the rest dequantized to %s) in %.1fs",
            self.path.name,
            len(keep),
            dtype,
            time.perf_counter() - start,
        )


@lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_checkpoint(path: str | Path) -> GGUFCheckpoint:
    """The GGUFCheckpoint of `path`, parsed once per file version (the tokenizer and the weights loader
    both read it; parsing a large vocabulary's metadata takes seconds)."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e}).") from e
    return _open(path, stat.st_mtime_ns, stat.st_size)
