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
# Bytes per element: the engine dtypes, and float8_e4m3fn for an FP8 KV cache (below).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
# The dtypes whose linear layers a CPU engine also keeps in oneDNN's packed layout (engine/cpu/linear.py;
# bfloat16 where the CPU runs it natively), so that sizing plans that second copy.
CPU_PREPACKED_DTYPES: tuple[DTypeName, ...] = ("float32", "bfloat16")


def resolve_dtype_name(dtype: str, on_cuda: bool, *, native_cpu_bfloat16: bool) -> DTypeName:
    """`auto` made concrete: bfloat16 on CUDA and on CPUs that run bfloat16 natively (AVX512-BF16 or
    AMX-BF16: `engine.cpu.isa`; there the engine measured 1.2-1.3x float32's throughput, see
    docs/benchmarks.md), float32 on other CPUs (bfloat16 emulated is slower); a name is returned as it is."""
    if dtype == "auto":
        return "bfloat16" if on_cuda or native_cpu_bfloat16 else "float32"
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return dtype


# ---- the KV cache's element type (`--kv-cache-dtype`)

# auto: the engine's dtype; fp8: float8 e4m3 (torch.float8_e4m3fn), one byte per element.
KVCacheDType = Literal["auto", "fp8"]
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = get_args(KVCacheDType)
# The torch name of each KV cache dtype that is not the engine's dtype.
KV_CACHE_TORCH_NAMES: dict[str, str] = {"fp8": "float8_e4m3fn"}


def kv_cache_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    """The element type of the KV cache: the engine's `dtype` for `auto`, float8_e4m3fn for `fp8`."""
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {kv_cache_dtype!r}"
        )
    return KV_CACHE_TORCH_NAMES.get(kv_cache_dtype, dtype)
