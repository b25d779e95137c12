"""The one table of weight formats the engine can serve (`--quantization`; no torch).

- `auto` (default): the checkpoint's own format. A GGUF file's Q8_0, Q4_0, Q4_1 and Q4_K tensors stay in
  their blocks on CPU (other GGUF types, and every type on CUDA or with tensor parallelism, are
  dequantized to the model's dtype as before); float checkpoints stay float.
- `none`: every weight dequantized to the model's dtype (what the engine did before weights could stay
  quantized).
- `int8`: int8 weight-only with one scale per output channel, quantized at load from the float (or
  dequantized GGUF) weights.
- `q8_0`, `q4_0`, `q4_1`: the float weights quantized at load into that GGUF block format (what
  llama.cpp's converter would write).
Quantized weights run on CPU with tensor_parallel_size 1 (engine/cpu/quantized.py).
"""

from __future__ import annotations

from typing import Literal, get_args

Quantization = Literal["auto", "none", "int8", "q8_0", "q4_0", "q4_1"]
QUANTIZATION_CHOICES: tuple[str, ...] = get_args(Quantization)
# Formats quantized at load from float weights (every choice but auto and none).
LOAD_TIME_FORMATS: tuple[str, ...] = ("int8", "q8_0", "q4_0", "q4_1")


def check_quantization(quantization: str, on_cuda: bool, tensor_parallel_size: int) -> None:
    """Raise ValueError naming the fix when `quantization` cannot run on this device / parallelism."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )
    if quantization not in LOAD_TIME_FORMATS:
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
