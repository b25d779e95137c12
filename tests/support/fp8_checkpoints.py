"""FP8 checkpoints as the Hugging Face hub has them, written from a float checkpoint folder: every decoder
projection stored float8 e4m3 with its scale, the rest (embeddings, LM head, norms) as it was.

Formats (engine/fp8/checkpoint.py): `per-tensor` (quant_method fp8, one `weight_scale` per tensor, a static
`input_scale` the engine ignores), `per-channel` (compressed-tensors float-quantized, `weight_scale`
[out, 1]) and `block` (quant_method fp8 with weight_block_size, `weight_scale_inv` per block).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

Fp8Format = Literal["per-tensor", "per-channel", "block"]
BLOCK = 32
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _block_scales(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
    padded[:rows, :cols] = weight.abs()
    blocks = padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = blocks.amax(dim=(1, 3)) / FP8_MAX
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return scale, full


def quantization_config(format: Fp8Format) -> dict[str, object]:
    if format == "per-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    if format == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def write_fp8_checkpoint(source: Path, out: Path, format: Fp8Format) -> Path:
    """`source` (a float folder with one model.safetensors) as an FP8 checkpoint in `out`."""
    out.mkdir(parents=True)
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, out / path.name)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        stem = name.removesuffix(".weight")
        if not (name.endswith(".weight") and stem.rsplit(".", 1)[-1] in PROJECTIONS):
            tensors[name] = tensor
            continue
        weight = tensor.float()
        if format == "per-tensor":
            scale = weight.abs().amax() / FP8_MAX
            tensors[name] = _quantize(weight, scale)
            tensors[f"{stem}.weight_scale"] = scale.reshape(())
            tensors[f"{stem}.input_scale"] = torch.tensor(0.05)
        elif format == "per-channel":
            scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
            tensors[name] = _quantize(weight, scale)
            tensors[f"{stem}.weight_scale"] = scale
        else:
            scale, full = _block_scales(weight)
            tensors[name] = _quantize(weight, full)
            tensors[f"{stem}.weight_scale_inv"] = scale
    save_file(tensors, out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(format)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def dequantized(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every weight of an FP8 checkpoint written above, float32, scales applied."""
    stored = load_file(checkpoint / "model.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.weight_scale" in stored:
            weights[name] = tensor.float() * stored[f"{stem}.weight_scale"].float()
        elif f"{stem}.weight_scale_inv" in stored:
            scale = stored[f"{stem}.weight_scale_inv"]
            rows, cols = tensor.shape
            full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
            weights[name] = tensor.float() * full
        else:
            weights[name] = tensor.float()
    return weights
