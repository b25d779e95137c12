"""Load a Llama-family checkpoint: a Hugging Face folder (config.json + safetensors, read directly) or a
single GGUF file (inflight/engine/gguf/, dequantized at load).

A tensor-parallel rank reads only its own slices of safetensors (`get_slice`), so it never holds the whole
checkpoint; a GGUF tensor is dequantized whole, then sliced."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from inflight.engine.attention.backend import AttentionBackend, get_attention_backend
from inflight.engine.gguf import is_gguf
from inflight.engine.gguf.checkpoint import open_checkpoint
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.errors import ModelLoadError
from inflight.engine.model.llama import LlamaForCausalLM, shard_layout

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some checkpoints carry that this model derives itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attention_backend: AttentionBackend | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> LlamaForCausalLM:
    """Build the model (rank `rank`'s shard of `world_size`) for `model_dir`'s config.json and fill it
    from its safetensors files, or (when `model_dir` is a .gguf file) from the GGUF file's metadata and
    tensors.

    Raises ModelLoadError naming the file and the problem when anything is missing, corrupt or unsupported
    (including a tensor-parallel size that cannot split the model).
    """
    model_dir = Path(model_dir)
    gguf = open_checkpoint(model_dir) if is_gguf(model_dir) else None
    if gguf is None and not model_dir.is_dir():
        raise ModelLoadError(
            f"{model_dir}: not a directory or .gguf file. Pass a Hugging Face checkpoint folder "
            "(make one with `inflight make-model --out DIR`) or a GGUF file."
        )
    torch_dtype = DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if torch_dtype is None or torch_dtype not in DTYPES.values():
        raise ModelLoadError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16.")
    config = gguf.config() if gguf is not None else ModelConfig.from_dir(model_dir)
    files = [model_dir] if gguf is not None else _weight_files(model_dir)
    try:
        layout = shard_layout(config, rank, world_size)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    device = torch.device(device)
    backend = attention_backend or get_attention_backend(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, device, layout)
    model = model.to(torch_dtype).to_empty(device=device)
    tensors = gguf.tensors(config, torch_dtype) if gguf is not None else _safetensors_tensors(files)
    _load_weights(model, tensors, files, config)
    model.zero_vocab_padding()
    return model.eval()


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{index}: not a valid safetensors index (expected JSON with a 'weight_map' object): {e}"
            ) from e
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} lists shard(s) that are not in {model_dir}: {', '.join(missing)}. "
                "Download the missing shards (or the whole checkpoint) again."
            )
        return [model_dir / n for n in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    found_bin = sorted(p.name for p in model_dir.glob("*.bin"))
    hint = (
        f" Only PyTorch pickles ({', '.join(found_bin)}) are present: convert them to safetensors."
        if found_bin
        else ""
    )
    raise ModelLoadError(f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file.{hint}")


class StoredTensor(Protocol):
    """A checkpoint tensor that can be read in part: a safetensors slice or an in-memory tensor."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def _shape(stored: StoredTensor) -> tuple[int, ...]:
    if isinstance(stored, torch.Tensor):
        return tuple(stored.shape)
    return tuple(stored.get_shape())  # type: ignore[attr-defined]  # safetensors' slice


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, StoredTensor]]:
    """(name, lazy slice) for every tensor, so a tensor-parallel rank reads only its own part."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_slice(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{path}: cannot read safetensors file ({e}). The file is corrupt or truncated; "
                "download or regenerate it."
            ) from e


def _load_weights(
    model: LlamaForCausalLM,
    tensors: Iterable[tuple[str, StoredTensor]],
    files: list[Path],
    config: ModelConfig,
) -> None:
    """Copy (this rank's part of) each (checkpoint name, tensor) into its place in `model`; `files` name
    the source in errors."""
    targets = model.weight_targets()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, stored in tensors:
        target = targets.get(name)
        if target is None:
            if not name.endswith(IGNORED_SUFFIXES) and not (
                name == "lm_head.weight" and config.tie_word_embeddings
            ):
                unexpected.append(name)
            continue
        shape = _shape(stored)
        if shape != target.checkpoint_shape:
            raise ModelLoadError(
                f"{', '.join(str(p) for p in files)}: tensor {name!r} has shape {shape}, but "
                f"the config ({config.architecture}, hidden_size={config.hidden_size}, "
                f"num_key_value_heads={config.num_key_value_heads}, head_dim={config.head_dim}) "
                f"needs {target.checkpoint_shape}. The weights do not belong to this config."
            )
        loaded.add(name)
        if target.param is None:
            continue
        tensor = stored[:] if target.source is None else stored[target.source]
        with torch.no_grad():
            dest = target.param if target.rows is None else target.param[target.rows]
            dest.copy_(tensor)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{', '.join(str(p) for p in files)}: missing tensor(s) {shown} required by "
            f"{config.architecture} with {config.num_hidden_layers} layers. The checkpoint is incomplete."
        )
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (
            f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        )
        raise ModelLoadError(
            f"{', '.join(str(p) for p in files)}: unexpected tensor(s) {shown} for {config.architecture}. "
            "The weights do not match config.json's architecture."
        )
