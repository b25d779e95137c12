"""Load a Llama-family checkpoint: a Hugging Face folder (config.json + safetensors, read directly) or a
single GGUF file (inflight/engine/gguf/, dequantized at load).

A tensor-parallel rank reads only its own slices of a safetensors file (`get_slice`), so it never holds
the whole checkpoint; from a GGUF file it dequantizes one whole tensor at a time and keeps its part."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from inflight.engine.attention.backend import AttentionBackend, get_attention_backend
from inflight.engine.dtypes import DTYPE_NAMES
from inflight.engine.gguf import is_gguf
from inflight.engine.gguf.checkpoint import GGUFCheckpoint, open_checkpoint
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.errors import ModelLoadError
from inflight.engine.model.llama import LlamaForCausalLM, WeightTarget, shard_layout

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some checkpoints carry that this model derives itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ModelLoadError(f"dtype {dtype} is not supported; use {', '.join(DTYPE_NAMES)}.")
    torch_dtype: torch.dtype = getattr(torch, name)
    config = read_config(model_dir)
    try:
        layout = shard_layout(config, rank, world_size)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    device = torch.device(device)
    files = [model_dir] if gguf is not None else _weight_files(model_dir)
    backend = attention_backend or get_attention_backend(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, device, layout)
    model = model.to(torch_dtype).to_empty(device=device)
    if gguf is not None:
        _load_gguf_weights(model, gguf, config, torch_dtype)
    else:
        _load_weights(model, files, config)
    model.zero_vocab_padding()
    return model.eval()


def read_config(model: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder (config.json) or of a GGUF file (its metadata)."""
    return open_checkpoint(model).config() if is_gguf(model) else ModelConfig.from_dir(model)


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


def _load_weights(model: LlamaForCausalLM, files: list[Path], config: ModelConfig) -> None:
    targets = model.weight_targets()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    stored = f.get_slice(name)
                    shape = tuple(stored.get_shape())
                    read = lambda source, s=stored: s[:] if source is None else s[source]  # noqa: E731
                    _place(targets, name, shape, read, config, str(path), loaded, unexpected)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{path}: cannot read safetensors file ({e}). The file is corrupt or truncated; "
                "download or regenerate it."
            ) from e
    _check_complete(targets, loaded, unexpected, files, config)


def _load_gguf_weights(
    model: LlamaForCausalLM, gguf: GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype
) -> None:
    targets = model.weight_targets()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in gguf.tensors(config, dtype):
        read = lambda source, t=tensor: t if source is None else t[source]  # noqa: E731
        _place(targets, name, tuple(tensor.shape), read, config, str(gguf.path), loaded, unexpected)
    _check_complete(targets, loaded, unexpected, [gguf.path], config)


def _place(
    targets: dict[str, WeightTarget],
    name: str,
    shape: tuple[int, ...],
    read: Callable[[tuple[slice, ...] | None], torch.Tensor],
    config: ModelConfig,
    where: str,
    loaded: set[str],
    unexpected: list[str],
) -> None:
    """Copy checkpoint tensor `name` (of `shape`; `read(source)` gives its part `source`) into its target."""
    target = targets.get(name)
    if target is None:
        if not name.endswith(IGNORED_SUFFIXES) and not (
            name == "lm_head.weight" and config.tie_word_embeddings
        ):
            unexpected.append(name)
        return
    if shape != target.checkpoint_shape:
        raise ModelLoadError(
            f"{where}: tensor {name!r} has shape {shape}, but the config "
            f"({config.architecture}, hidden_size={config.hidden_size}, "
            f"num_key_value_heads={config.num_key_value_heads}, head_dim={config.head_dim}) "
            f"needs {target.checkpoint_shape}. The weights do not belong to this config."
        )
    loaded.add(name)
    if target.param is None:
        return
    tensor = read(target.source)
    with torch.no_grad():
        dest = target.param if target.rows is None else target.param[target.rows]
        dest.copy_(tensor)


def _check_complete(
    targets: dict[str, WeightTarget],
    loaded: set[str],
    unexpected: list[str],
    files: list[Path],
    config: ModelConfig,
) -> None:
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
