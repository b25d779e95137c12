"""Load a Llama-family checkpoint: a Hugging Face folder (config.json + safetensors, read directly) or a
single GGUF file (inflight/engine/gguf/).

Weights are float in the model's dtype, or kept quantized (`quantization`, see engine/quantization.py):
on CPU a GGUF file's Q8_0 / Q4 blocks repacked once, or float weights quantized at load; on any device the
decoder projections in FP8 (engine/fp8/), quantized at load or as an FP8 checkpoint stores them. The
modules that stay quantized are swapped for QuantizedLinear / QuantizedEmbedding / Fp8Linear before any
memory is allocated, so their float weights never exist.

A tensor-parallel rank reads only its own slices of a safetensors file (`get_slice`), so it never holds
the whole checkpoint; from a GGUF file it dequantizes one whole tensor at a time and keeps its part."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from inflight.engine.attention.backend import AttentionBackend, get_attention_backend
from inflight.engine.cpu import huge_pages
from inflight.engine.cpu.quant_layout import Layout, whole_blocks
from inflight.engine.cpu.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedTensor
from inflight.engine.dtypes import DTYPE_NAMES
from inflight.engine.fp8.checkpoint import (
    SCALE_SUFFIXES,
    STORED_DTYPE,
    UNUSED_SUFFIXES,
    Fp8Checkpoint,
    fp8_checkpoint,
    fp8_part,
    scale_names,
)
from inflight.engine.fp8.weights import Fp8Linear, Fp8Weight, quantize_fp8
from inflight.engine.gguf import is_gguf
from inflight.engine.gguf.checkpoint import GGUFCheckpoint, open_checkpoint
from inflight.engine.gguf.repack import KEPT_GGUF_TYPES, quantize
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.errors import ModelLoadError
from inflight.engine.model.llama import LlamaForCausalLM, WeightTarget, shard_layout
from inflight.engine.quantization import CPU_LAYOUTS, GGUF_ONLY_FORMATS, LOAD_TIME_FORMATS, check_quantization

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
    quantization: str = "auto",
) -> LlamaForCausalLM:
    """Build the model (rank `rank`'s shard of `world_size`) for `model_dir`'s config.json and fill it
    from its safetensors files, or (when `model_dir` is a .gguf file) from the GGUF file's metadata and
    tensors; weights in `quantization` (engine/quantization.py).

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
    try:
        check_quantization(quantization, device.type == "cuda", world_size, gguf is not None)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    if quantization in GGUF_ONLY_FORMATS:
        quantization = "auto"  # the file's own blocks
    fp8_format = None if gguf is not None else _fp8_format(model_dir)
    if quantization == "auto" and fp8_format is not None:
        quantization = "fp8"  # the checkpoint's own float8 weights
    files = [model_dir] if gguf is not None else _weight_files(model_dir)
    backend = attention_backend or get_attention_backend(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, device, layout)
    model = model.to(torch_dtype)
    formats = (
        _quantized_formats(model, quantization, gguf) if device.type == "cpu" and world_size == 1 else {}
    )
    _swap_quantized(model, formats, torch_dtype)
    if quantization == "fp8":
        _swap_fp8(model)
    model = model.to_empty(device=device)
    # The float weights fault in as huge pages as they are read in (prepare_linears collapses the rest).
    huge_pages.advise(model.parameters())
    targets = model.weight_targets()
    if gguf is not None:
        _load_gguf_weights(targets, gguf, config, torch_dtype, quantization)
    else:
        _load_weights(targets, files, config, quantization, fp8_format)
    model.zero_vocab_padding()
    return model.eval()


def read_config(model: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder (config.json) or of a GGUF file (its metadata)."""
    return open_checkpoint(model).config() if is_gguf(model) else ModelConfig.from_dir(model)


def _fp8_format(model_dir: Path) -> Fp8Checkpoint | None:
    """The FP8 format config.json's quantization_config names (None: a float checkpoint)."""
    path = model_dir / "config.json"
    try:
        return fp8_checkpoint(json.loads(path.read_text()))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e


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


def _quantized_formats(
    model: LlamaForCausalLM, quantization: str, gguf: GGUFCheckpoint | None
) -> dict[str, Layout]:
    """Module name -> the kernel layout its weight is kept in, for the projections, the LM head and the
    embedding that stay quantized: every one with a multiple of 32 input features for a load-time format;
    with `auto`, each whose GGUF tensors are all of kept types of one format (e.g. a fused q/k/v with a
    Q4_1 q and a Q8_0 v is dequantized), with float32 scales where one of them needs them (a Q4_K part)."""
    if quantization in ("none", "fp8") or (quantization == "auto" and gguf is None):
        return {}
    owner = {
        id(module.weight): name
        for name, module in model.named_modules()
        if type(module) in (nn.Linear, nn.Embedding) and whole_blocks(module.weight.shape[-1])
    }
    if quantization in LOAD_TIME_FORMATS:
        return dict.fromkeys(owner.values(), CPU_LAYOUTS[quantization])
    assert gguf is not None
    types = gguf.tensor_types()
    parts: dict[str, list[Layout | None]] = {}
    for hf_name, target in model.weight_targets().items():
        module = owner.get(id(target.param))
        if module is not None and hf_name in types:
            parts.setdefault(module, []).append(KEPT_GGUF_TYPES.get(types[hf_name]))
    formats: dict[str, Layout] = {}
    for module, layouts in parts.items():
        kept = [layout for layout in layouts if layout is not None]
        if len(kept) == len(layouts) and len({layout.format for layout in kept}) == 1:
            wide = any(layout.scale_dtype == "float32" for layout in kept)
            formats[module] = Layout(kept[0].format, "float32" if wide else "float16")
    return formats


def _swap_quantized(model: nn.Module, formats: dict[str, Layout], dtype: torch.dtype) -> None:
    """Replace each module named in `formats` by its quantized counterpart (empty: the loader fills it)."""
    for name, format in formats.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, attribute)
        replacement: nn.Module
        if isinstance(module, nn.Embedding):
            replacement = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, format, dtype)
        else:
            replacement = QuantizedLinear(module.in_features, module.out_features, format, module.bias)
        setattr(parent, attribute, replacement)


def _swap_fp8(model: nn.Module) -> None:
    """Replace the decoder layers' projections by Fp8Linear (on the meta device: the loader fills them);
    the embedding and the LM head stay in the model's dtype."""
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name.startswith("layers."):
            parent_name, _, attribute = name.rpartition(".")
            with torch.device("meta"):
                replacement = Fp8Linear(module.in_features, module.out_features, module.bias)
            setattr(model.get_submodule(parent_name), attribute, replacement)


def _fp8_scales(files: list[Path]) -> dict[str, torch.Tensor]:
    """The scale tensors of an FP8 checkpoint's weights, by name (small; read first, as a weight's scale
    may be in another shard)."""
    scales: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith(SCALE_SUFFIXES):
                        scales[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors file ({e}); download it again.") from e
    return scales


def _fp8_reader(
    name: str,
    shape: tuple[int, ...],
    stored: Any,
    scales: dict[str, torch.Tensor],
    fp8_format: Fp8Checkpoint | None,
    where: str,
) -> Callable[[tuple[slice, ...] | None], torch.Tensor | Fp8Weight]:
    """How to read part of the stored float8 weight `name` with its scale."""
    if stored.get_dtype() != STORED_DTYPE:
        raise ModelLoadError(
            f"{where}: tensor {name!r} is {stored.get_dtype()}; inflight reads float8 weights in e4m3 "
            f"({STORED_DTYPE}) only"
        )
    scale = next((scales[n] for n in scale_names(name) if n in scales), None)
    if fp8_format is None or scale is None or len(shape) != 2:
        raise ModelLoadError(
            f"{where}: tensor {name!r} is float8 but "
            + ("config.json has no FP8 quantization_config" if fp8_format is None else "has no weight_scale")
            + "; the checkpoint is incomplete or not an FP8 release inflight reads (docs/models.md)"
        )

    def read(source: tuple[slice, ...] | None) -> torch.Tensor | Fp8Weight:
        values = stored[:] if source is None else stored[source]
        try:
            return fp8_part(values, scale, shape, source, fp8_format)
        except ValueError as e:
            raise ModelLoadError(f"{where}: tensor {name!r}: {e}") from e

    return read


def _slice_reader(stored: Any) -> Callable[[tuple[slice, ...] | None], torch.Tensor]:
    """How to read part of a stored float tensor (a safetensors slice)."""
    return lambda source: stored[:] if source is None else stored[source]


def _load_weights(
    targets: dict[str, WeightTarget],
    files: list[Path],
    config: ModelConfig,
    quantization: str,
    fp8_format: Fp8Checkpoint | None,
) -> None:
    loaded: set[str] = set()
    unexpected: list[str] = []
    scales = _fp8_scales(files) if fp8_format is not None else {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if fp8_format is not None and name.endswith(SCALE_SUFFIXES + UNUSED_SUFFIXES):
                        continue
                    stored = f.get_slice(name)
                    shape = tuple(stored.get_shape())
                    read = (
                        _fp8_reader(name, shape, stored, scales, fp8_format, str(path))
                        if stored.get_dtype().startswith("F8_")
                        else _slice_reader(stored)
                    )
                    _place(targets, name, shape, read, config, str(path), loaded, unexpected, quantization)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{path}: cannot read safetensors file ({e}). The file is corrupt or truncated; "
                "download or regenerate it."
            ) from e
    _check_complete(targets, loaded, unexpected, files, config)


def _load_gguf_weights(
    targets: dict[str, WeightTarget],
    gguf: GGUFCheckpoint,
    config: ModelConfig,
    dtype: torch.dtype,
    quantization: str,
) -> None:
    # With `auto`, the tensors whose target stays quantized are read as blocks, never dequantized.
    keep = (
        {name for name, t in targets.items() if isinstance(t.param, QuantizedTensor)}
        if quantization == "auto"
        else set()
    )
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in gguf.tensors(config, dtype, keep):
        read = lambda source, t=tensor: t if source is None else t[source]  # noqa: E731
        _place(
            targets, name, tuple(tensor.shape), read, config, str(gguf.path), loaded, unexpected, quantization
        )
    _check_complete(targets, loaded, unexpected, [gguf.path], config)


def _place(
    targets: dict[str, WeightTarget],
    name: str,
    shape: tuple[int, ...],
    read: Callable[[tuple[slice, ...] | None], torch.Tensor | QuantizedTensor | Fp8Weight],
    config: ModelConfig,
    where: str,
    loaded: set[str],
    unexpected: list[str],
    quantization: str,
) -> None:
    """Copy checkpoint tensor `name` (of `shape`; `read(source)` gives its part `source`) into its target;
    a float tensor whose target is quantized is quantized to `quantization` on the way, an FP8 one whose
    target is not FP8 dequantized."""
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
        if isinstance(dest, Fp8Weight):
            assert not isinstance(tensor, QuantizedTensor)  # GGUF blocks are kept with `auto` only
            dest.copy_(tensor if isinstance(tensor, Fp8Weight) else quantize_fp8(tensor))
            return
        if isinstance(tensor, Fp8Weight):
            tensor = tensor.dequantize()
        if isinstance(dest, QuantizedTensor):
            dest.copy_(tensor if isinstance(tensor, QuantizedTensor) else quantize(tensor, quantization))
        elif isinstance(tensor, torch.Tensor):
            dest.copy_(tensor)
        else:
            raise ModelLoadError(f"{where}: tensor {name!r} is quantized but its target is not")


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
