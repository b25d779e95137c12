"""The one table of weight formats (no torch): what `--quantization` (serve, size, bench) and
`spec.model.quantization` may name, the bytes each stores per weight, and where the engine can run it.

- `auto` (the engine's default): the checkpoint's own format. A GGUF file's Q8_0, Q4_0, Q4_1 and Q4_K
  tensors stay in their blocks on CPU (other GGUF types, and every type on CUDA or with tensor
  parallelism, are dequantized to the model's dtype); an FP8 checkpoint (config.json
  `quantization_config`, engine/fp8/checkpoint.py) stays FP8; float checkpoints stay float. Sizing cannot
  see a checkpoint, so it plans `auto` like `none`: name the format to plan its bytes.
- `none`: every weight dequantized to the model's dtype.
- `int8`: int8 weight-only with one scale per output channel, quantized at load (CPU).
- `q8_0`, `q4_0`, `q4_1`: the float weights quantized at load into that GGUF block format (CPU).
- `q4_k`: a GGUF file's own Q4_K tensors (what `auto` keeps; the engine does not make Q4_K at load).
- `fp8`: float8 e4m3 weights with per-channel scales (engine/fp8/), quantized at load from a float
  checkpoint or kept from an FP8 one; on every device and with tensor parallelism. The GPU multiplies
  them on FP8 tensor cores (compute capability 8.9+), older GPUs by a Triton kernel, the CPU by
  dequantizing per call (for testing and memory, not speed).

The formats quantize the decoder's linear layers (attention q/k/v/o and the MLP); for sizing, embeddings,
the LM head and the norms stay in the engine's dtype (FP8 and INT8 checkpoints on the Hugging Face hub
keep them so; sizing a GGUF file this way slightly overestimates it, whose embeddings are quantized too).
GGUF formats are stored in blocks (`ggml` block layouts): Q8_0 32 int8 weights + one float16 scale
(34 bytes / 32), Q4_0 32 4-bit weights + a float16 scale (18 / 32), Q4_1 + a float16 minimum (20 / 32),
Q4_K super-blocks of 256 weights in 144 bytes. FP8 and INT8 carry per-channel scales (a few bytes per
output row: left out).
"""

from __future__ import annotations

from typing import Literal, get_args

Quantization = Literal["auto", "none", "fp8", "int8", "q8_0", "q4_0", "q4_1", "q4_k"]
QUANTIZATION_CHOICES: tuple[str, ...] = get_args(Quantization)

# Bytes per weight of a quantized layer; None: the engine's dtype (DTYPE_BYTES).
QUANTIZED_WEIGHT_BYTES: dict[str, float | None] = {
    "auto": None,
    "none": None,
    "fp8": 1.0,
    "int8": 1.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "q4_k": 144 / 256,
}

# Formats whose matrix multiplies run at speed on FP8 tensor cores only (Ada Lovelace / Hopper and later);
# sizing plans them on such GPUs.
NEEDS_FP8_GPU: frozenset[str] = frozenset({"fp8"})
# Formats the CPU engine quantizes float weights into at load.
LOAD_TIME_FORMATS: tuple[str, ...] = ("int8", "q8_0", "q4_0", "q4_1")
# Formats read only from a GGUF file that holds them.
GGUF_ONLY_FORMATS: frozenset[str] = frozenset({"q4_k"})


def check_known(quantization: str) -> None:
    """Raise ValueError listing the choices when `quantization` is not one of them."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )


def check_quantization(quantization: str, on_cuda: bool, tensor_parallel_size: int, gguf: bool) -> None:
    """Raise ValueError naming the fix when the engine cannot serve `quantization` on this device and
    parallelism from this checkpoint (`gguf`: a GGUF file)."""
    check_known(quantization)
    if quantization in GGUF_ONLY_FORMATS and not gguf:
        raise ValueError(
            f"--quantization {quantization} keeps a GGUF file's own {quantization.upper()} tensors; this "
            "checkpoint is not a GGUF file (quantize at load with q4_0, q4_1, q8_0 or int8 instead)"
        )
    if quantization not in LOAD_TIME_FORMATS and quantization not in GGUF_ONLY_FORMATS:
        return
    if on_cuda:
        raise ValueError(
            f"--quantization {quantization} runs on CPU only; on CUDA use --quantization none (or auto)"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"--quantization {quantization} needs --tensor-parallel-size 1 (quantized weights are not "
            "split over ranks yet); use --quantization none to split a model"
        )
