"""The one table of data types the engine runs in (no torch): names, their bytes, the `auto` choice.

Every dtype list (engine config, model config, loader, sizing, command-line choices) comes from here;
the torch type of a name is `getattr(torch, name)`.
"""

from __future__ import annotations

from typing import Literal, get_args

DTypeName = Literal["float32", "bfloat16", "float16"]
# What a user may ask for: a name, or "auto" (see resolve_dtype_name).
DType = Literal["auto", DTypeName]

DTYPE_NAMES: tuple[DTypeName, ...] = get_args(DTypeName)
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPE_NAMES)
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_dtype_name(dtype: str, on_cuda: bool, *, native_cpu_bfloat16: bool) -> DTypeName:
    """`auto` made concrete: bfloat16 on CUDA and on CPUs that run bfloat16 natively (AVX512-BF16 or
    AMX-BF16: `engine.cpu.isa`; there the engine measured 1.2-1.3x float32's throughput, see
    docs/benchmarks.md), float32 on other CPUs (bfloat16 emulated is slower); a name is returned as it is."""
    if dtype == "auto":
        return "bfloat16" if on_cuda or native_cpu_bfloat16 else "float32"
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return dtype
