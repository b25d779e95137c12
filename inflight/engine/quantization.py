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

Each CPU format is held in one of the kernels' block layouts (`CPU_LAYOUTS`; engine/cpu/quant_layout.py,
which quant_kernels.c is compiled from), and its bytes per weight are that layout's: what the engine
holds, not what a GGUF file stores. Blocks of 32 weights with their scale (and u4's offset): `int8` and
`q8_0` 32 bytes + a float16 scale (34 / 32 = 1.0625; int8's scale is its row's, repeated per block);
`q4_0` and `q4_1` 16 bytes + a float16 scale and offset (20 / 32 = 0.625; a Q4_0 file stores 18 / 32,
its offset -8 x scale is added at load); `q4_k` 16 bytes + a float32 scale and offset (24 / 32 = 0.75;
the file's super-blocks store 144 / 256 = 0.5625, each sub-block's scale is a product of two). `fp8`:
one byte a weight (its per-channel scales, a few bytes per output row, left out).

Which matrices a format holds in its bytes (`holds_quantized`, what sizing counts): `fp8` the decoder's
linear layers (attention q/k/v/o and the MLP); the formats quantized at load every matrix with a
multiple of 32 input features, the embedding and the LM head too (engine/loader.py); a GGUF file's own
`q4_k` its linear layers, its embeddings counted in the engine's dtype (sizing cannot see which types
the file gives them: it overestimates a file whose embeddings are quantized). Norms and biases stay in
the engine's dtype.
"""

from __future__ import annotations

from typing import Literal, get_args

from inflight.engine.cpu.quant_layout import Layout, whole_blocks

Quantization = Literal["auto", "none", "fp8", "int8", "q8_0", "q4_0", "q4_1", "q4_k"]
QUANTIZATION_CHOICES: tuple[str, ...] = get_args(Quantization)

# The kernel layout each CPU format is held in: float16 scales where the file's (or int8's, chosen in
# float16) are, float32 for Q4_K's (a float16 times a 6-bit scale needs up to 17 bits). engine/gguf/repack.py
# repacks into these.
CPU_LAYOUTS: dict[str, Layout] = {
    "int8": Layout("s8", "float16"),
    "q8_0": Layout("s8", "float16"),
    "q4_0": Layout("u4", "float16"),
    "q4_1": Layout("u4", "float16"),
    "q4_k": Layout("u4", "float32"),
}
# Bytes the engine holds per weight of a quantized matrix; None: the engine's dtype (DTYPE_BYTES).
QUANTIZED_WEIGHT_BYTES: dict[str, float | None] = {
    "auto": None,
    "none": None,
    "fp8": 1.0,
    **{name: layout.bytes_per_weight for name, layout in CPU_LAYOUTS.items()},
}

# Formats whose matrix multiplies run at speed on FP8 tensor cores only (Ada Lovelace / Hopper and later);
# sizing plans them on such GPUs.
NEEDS_FP8_GPU: frozenset[str] = frozenset({"fp8"})
# Formats the CPU engine quantizes float weights into at load.
LOAD_TIME_FORMATS: tuple[str, ...] = ("int8", "q8_0", "q4_0", "q4_1")
# Formats read only from a GGUF file that holds them.
GGUF_ONLY_FORMATS: frozenset[str] = frozenset({"q4_k"})


def holds_quantized(quantization: str, input_features: int, embedding: bool) -> bool:
    """Whether the engine holds a matrix with `input_features` columns in `quantization`'s bytes per weight:
    `embedding` for the embedding table and the LM head, else one of the decoder's linear layers."""
    if QUANTIZED_WEIGHT_BYTES[quantization] is None:
        return False
    if quantization not in CPU_LAYOUTS:
        return not embedding
    if not whole_blocks(input_features):
        return False
    return quantization in LOAD_TIME_FORMATS or not embedding


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
