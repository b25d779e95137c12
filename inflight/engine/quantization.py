"""The one table of weight formats (no torch): what `--quantization` and `spec.model.quantization` may
name, and the bytes each stores per weight of the layers it quantizes.

`none` keeps the checkpoint's weights in the engine's dtype. The other formats quantize the decoder's
linear layers (attention q/k/v/o and the MLP); embeddings, the LM head and the norms stay in the engine's
dtype (FP8 and INT8 checkpoints on the Hugging Face hub keep them so; sizing a GGUF file this way
slightly overestimates it, whose embeddings are quantized too). GGUF formats are stored in blocks
(`ggml` block layouts): Q8_0 32 int8 weights + one float16 scale (34 bytes / 32), Q4_0 32 4-bit weights
+ a float16 scale (18 / 32), Q4_1 + a float16 minimum (20 / 32), Q4_K super-blocks of 256 weights in 144
bytes. FP8 (e4m3) and INT8 carry per-channel scales (a few bytes per output row: left out).
"""

from __future__ import annotations

from typing import Literal, get_args

Quantization = Literal["none", "fp8", "int8", "q8_0", "q4_0", "q4_1", "q4_k"]
QUANTIZATION_CHOICES: tuple[str, ...] = get_args(Quantization)

# Bytes per weight of a quantized layer; None: the engine's dtype (DTYPE_BYTES).
QUANTIZED_WEIGHT_BYTES: dict[str, float | None] = {
    "none": None,
    "fp8": 1.0,
    "int8": 1.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "q4_k": 144 / 256,
}

# Formats whose matrix multiplies need FP8 tensor cores on a GPU (Ada Lovelace / Hopper and later).
NEEDS_FP8_GPU: frozenset[str] = frozenset({"fp8"})
