"""Load a Hugging Face Llama-family checkpoint folder: config.json + safetensors, read directly.

A tensor-parallel rank reads only its own slices (`get_slice`), so it never holds the whole checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from inflight.engine.attention.backend import AttentionBackend, get_attention_backend
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
    from its safetensors files.

    Raises ModelLoadError naming the file and the problem when anything is missing, corrupt or unsupported
    (including a tensor-parallel size that cannot split the model).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"{model_dir}: not a directory. Pass a Hugging Face checkpoint folder "
            "(make one with `inflight make-model --out DIR`)."
        )
    torch_dtype = DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if torch_dtype not in DTYPES.values():
        raise ModelLoadError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16.")
    config = ModelConfig.from_dir(model_dir)
    try:
        layout = shard_layout(config, rank, world_size)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    device = torch.device(device)
    files = _weight_files(model_dir)
    backend = attention_backend or get_attention_backend(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, device, layout)
    model = model.to(torch_dtype).to_empty(device=device)
    _load_weights(model, files, config)
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


def _load_weights(model: LlamaForCausalLM, files: list[Path], config: ModelConfig) -> None:
    targets = model.weight_targets()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    target = targets.get(name)
                    if target is None:
                        if not name.endswith(IGNORED_SUFFIXES) and not (
                            name == "lm_head.weight" and config.tie_word_embeddings
                        ):
                            unexpected.append(name)
                        continue
                    stored = f.get_slice(name)
                    shape = tuple(stored.get_shape())
                    if shape != target.checkpoint_shape:
                        raise ModelLoadError(
                            f"{path}: tensor {name!r} has shape {shape}, but config.json "
                            f"({config.architecture}, hidden_size={config.hidden_size}, "
                            f"num_key_value_heads={config.num_key_value_heads}, head_dim={config.head_dim}) "
                            f"needs {target.checkpoint_shape}. The weights do not belong to this config.json."
                        )
                    loaded.add(name)
                    if target.param is None:
                        continue
                    tensor = stored[:] if target.source is None else stored[target.source]
                    with torch.no_grad():
                        dest = target.param if target.rows is None else target.param[target.rows]
                        dest.copy_(tensor)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{path}: cannot read safetensors file ({e}). The file is corrupt or truncated; "
                "download or regenerate it."
            ) from e
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
