"""FP8 checkpoints as released on the Hugging Face hub, read into Fp8Weights (engine/fp8/weights.py).

config.json's `quantization_config` names the format:

- `quant_method: "fp8"` (transformers' FP8 / AutoFP8 / llm-compressor exports) and `"fbgemm_fp8"`: each
  quantized `X.weight` is float8 e4m3 with `X.weight_scale` (one per tensor, shape [] or [1], or per output
  channel, [out] or [out, 1]); with `weight_block_size` [bo, bi] (DeepSeek-V3, Qwen3 FP8 releases),
  `X.weight_scale_inv` holds one scale per bo x bi block.
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (llm-compressor): the same
  `X.weight` + `X.weight_scale`, per tensor ([1]) or per channel ([out, 1]), or per block.

The value is always scale * W8. Per-tensor and per-channel weights are kept as stored (a per-tensor scale
becomes every row's scale). Block-scaled weights are dequantized at load: kept in the model's dtype, or
(with fp8) requantized per channel, one more rounding. Static activation scales (`input_scale`) and KV
scales (`k_scale`, `v_scale`) are not read: the engine quantizes activations per token as it runs, and its
FP8 KV cache stores values unscaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inflight.engine.fp8.weights import Fp8Weight

# Checkpoint tensors that are not weights: the scales (read with their weight) and the unused static ones.
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
# safetensors' name for float8 e4m3fn.
STORED_DTYPE = "F8_E4M3"


def scale_names(weight_name: str) -> tuple[str, ...]:
    """The names the scale of checkpoint weight `weight_name` ("....weight") may have."""
    return tuple(weight_name.removesuffix(".weight") + suffix for suffix in SCALE_SUFFIXES)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """An FP8 checkpoint's format: the scale block [rows, cols] of block-scaled weights, else None."""

    block: tuple[int, int] | None = None


def fp8_checkpoint(config: dict[str, Any]) -> Fp8Checkpoint | None:
    """The FP8 format of a checkpoint from its config.json; None for a float checkpoint. Raises ValueError
    naming what is not supported."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method in ("fp8", "fbgemm_fp8"):
        return Fp8Checkpoint(_block(quantization.get("weight_block_size")))
    if method == "compressed-tensors":
        format = quantization.get("format")
        if format != "float-quantized":
            raise ValueError(
                f"compressed-tensors format {format!r} is not supported; inflight reads 'float-quantized' "
                "(FP8 weights) checkpoints, or float ones"
            )
        blocks = set()
        for name, group in (quantization.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ValueError(
                    f"compressed-tensors group {name!r} stores {weights.get('num_bits')}-bit "
                    f"{weights.get('type')} weights; inflight reads 8-bit float (FP8) ones"
                )
            blocks.add(_block(weights.get("block_structure")))
        return Fp8Checkpoint(blocks.pop() if len(blocks) == 1 else None)
    raise ValueError(
        f"quantization_config quant_method {method!r} is not supported; inflight reads float checkpoints and "
        "FP8 ones (quant_method fp8, fbgemm_fp8, or compressed-tensors float-quantized)"
    )


def _block(size: Any) -> tuple[int, int] | None:
    if not size:
        return None
    rows, cols = size
    return int(rows), int(cols)


def fp8_part(
    values: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, ...],
    source: tuple[slice, ...] | None,
    checkpoint: Fp8Checkpoint,
) -> Fp8Weight | torch.Tensor:
    """The part `source` (all when None) of a stored float8 weight of `shape`, whose part `values` is,
    with its stored `scale`: an Fp8Weight, or for a block-scaled weight the float32 values. Raises
    ValueError when the scale's shape fits no format."""
    out_features, in_features = shape
    rows = source[0] if source else slice(None)
    if scale.numel() == 1:
        row_scale = scale.float().reshape(1).expand(out_features)
    elif tuple(scale.shape) in ((out_features,), (out_features, 1)):
        row_scale = scale.float().reshape(out_features)
    elif checkpoint.block is not None and tuple(scale.shape) == tuple(
        -(-size // block) for size, block in zip(shape, checkpoint.block, strict=True)
    ):
        cols = source[1] if source and len(source) > 1 else slice(None)
        block_rows = torch.arange(out_features)[rows] // checkpoint.block[0]
        block_cols = torch.arange(in_features)[cols] // checkpoint.block[1]
        return values.float() * scale.float()[block_rows][:, block_cols]
    else:
        raise ValueError(
            f"its scale has shape {tuple(scale.shape)}, which is not per tensor, per output channel "
            f"({out_features}) or per block of {checkpoint.block}"
        )
    return Fp8Weight(values, row_scale[rows].contiguous())
