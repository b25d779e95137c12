"""Small C kernels for CPU inference (kernels.c), compiled at first use and called through ctypes.

PyTorch on CPU spends a large share of a decode step outside its matrix multiplies: paged attention
gathers every sequence's K/V blocks into a contiguous buffer before SDPA reads them again, and each
elementwise step of a decoder layer (residual add, RMSNorm, rotary, SiLU * up) is several separate
passes, each with its own dispatch. The kernels here do each of those in one pass: decode attention
straight from the blocks (attention/cpu_paged.py), one fused call per elementwise step (model/ops.py),
the sampler's argmax (sampler.py; torch.argmax over a batch of 49152-entry rows took ~1 ms) and the
grammar masks on the logits (guided.py).

The library is compiled with the system C compiler (`$CC`, else `cc`) into $INFLIGHT_CACHE_DIR/kernels
(default ~/.cache/inflight/kernels), keyed by the C sources, the compiler and the CPU, so it is built once
per machine type (about a second). Where there is no compiler, the build fails, or INFLIGHT_CPU_KERNELS=0,
the engine logs why and uses the PyTorch code: same results within float rounding, slower.
float32 and bfloat16 use the kernels; float16 always uses PyTorch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from inflight.cache import cache_dir
from inflight.engine.cpu import quant_layout

logger = logging.getLogger("inflight.engine")

SOURCE = Path(__file__).with_name("kernels.c")
# Compiled into the same library: the weight-quantized linear layers (cpu/quantized.py), and a decode
# step's whole decoder layer over quantized or float weights (model/decode_layer.py), which calls the
# kernels of both files.
QUANT_SOURCE = Path(__file__).with_name("quant_kernels.c")
DECODE_LAYER_SOURCE = Path(__file__).with_name("decode_layer.c")
DISABLE_ENV = "INFLIGHT_CPU_KERNELS"
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-fPIC",
    "-shared",
    "-std=gnu11",
)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# The attention kernels' KV cache element types: the dtype's, or float8 e4m3 (`--kv-cache-dtype fp8`).
KV_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e4m3fn: 2}

_CType = type[ctypes.c_void_p | ctypes.c_int64 | ctypes.c_int | ctypes.c_float]
_ptr: _CType = ctypes.c_void_p
_i64: _CType = ctypes.c_int64
_int: _CType = ctypes.c_int
_float: _CType = ctypes.c_float
# Every exported function and its C signature (argument types, return type or None for void).
SIGNATURES: dict[str, tuple[list[_CType], _CType | None]] = {
    # q, q_row_stride, k_cache, v_cache, block_tables, table_stride, lens, rows, seqs, n, num_heads,
    # num_kv_heads, head_dim, block_size, window, scale, dtype, kv_dtype, out, max_seq_len, num_threads
    "paged_decode": (
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr]
        + [_i64] * 6
        + [_float, _int, _int, _ptr, _i64, _int],
        _int,
    ),
    # q, q_row_stride, k_cache, v_cache, block_tables, table_stride, prompts, n, num_heads, num_kv_heads,
    # head_dim, block_size, window, scale, dtype, kv_dtype, out, max_seq_len, num_threads
    "paged_prefill": (
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr] + [_i64] * 6 + [_float, _int, _int, _ptr, _i64, _int],
        _int,
    ),
    # x, residual (or NULL), weight, out, rows, hidden, eps, dtype, num_threads
    "rms_norm": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int, _int], None),
    # gate_up, out, rows, width, dtype, num_threads
    "silu_and_mul": ([_ptr, _ptr, _i64, _i64, _int, _int], None),
    # x, row_stride, cos, sin, rows, heads, head_dim, dtype, num_threads
    "rotary": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _int, _int], None),
    # k, v, row_stride (bytes), k_cache, v_cache, slots, rows, row_bytes
    "write_kv": ([_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64], None),
    # x (float32), rows, cols, out (int64), num_threads
    "argmax_rows": ([_ptr, _i64, _i64, _ptr, _int], None),
    # logits (float32), rows, vocab, inv_temperature (float32), min_p (float32), out (float32), num_threads
    "tempered_weights": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int], None),
    # weights (float32), rows, vocab, block, noise (float32), out (int64), num_threads
    "race_rows": ([_ptr, _i64, _i64, _i64, _ptr, _ptr, _int], None),
    # logits (float32), row_stride, rows (int64), bitmask (int32), n, words, vocab, num_threads
    "apply_token_bitmask": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _int], None),
    # x, rows, k, weight, n, bias (or NULL), dtype, out, out_dtype, num_threads: a few rows x float weights
    "dense_linear": ([_ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _ptr, _int, _int], _int),
    # 1 where paged_prefill multiplies bfloat16 prompts on the AMX tiles (built for and allowed on this CPU)
    "prefill_tiles": ([], _int),
    # dtype, k: how many rows dense_linear takes by k columns on this build (0: not vectorized, use oneDNN)
    "dense_linear_max_rows": ([_int, _i64], _int),
    # quant_kernels.c: x, rows, k, qweight, scales, mins, format (quant_layout.Layout.kernel_code), n, bias,
    # dtype, out, out_dtype, num_threads
    "quant_linear": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _ptr, _int, _ptr, _int, _int], _int),
    # qweight, scales, mins, format, k, ids, count, dtype, out, num_threads
    "quant_rows": ([_ptr, _ptr, _ptr, _int, _i64, _ptr, _i64, _int, _ptr, _int], _int),
    # 1 where quant_linear quantizes x to int8 (AVX-512 VNNI), 0 where it multiplies in float
    "quant_linear_int8_activations": ([], _int),
    # x (float32), rows, k, qweight, scales, mins, format, n, bias (float32 or NULL), out (float32),
    # num_threads: prompt rows by the weights dequantized panel by panel (AVX-512 and AVX2 builds)
    "quant_linear_float": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _ptr, _ptr, _int], _int),
    # 1 where this build has quant_linear_float
    "quant_linear_float_built": ([], _int),
    # decode_layer.c: each layer's weights (struct pointers), k caches, v caches, count, step (struct),
    # hidden, residual, first
    "decode_layers": ([_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _int, _int], _int),
}


class KernelBuildError(RuntimeError):
    pass


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted))) or platform.machine()


def build_library(
    compiler: str | None = None,
    out_dir: Path | None = None,
    flags: tuple[str, ...] = COMPILE_FLAGS,
    kernels_source: Path | None = None,
    source_dir: Path = SOURCE.parent,
) -> Path:
    """Compile kernels.c, quant_kernels.c and decode_layer.c into one library (once per
    source, compiler, flags and CPU) and return its path.

    `flags` other than the default are for tests (e.g. without -march=native: the portable C path);
    `source_dir`, a folder holding another version of all the C files, and `kernels_source`, another
    kernels.c in place of the folder's, for benchmarks comparing older ones."""
    kernels_source = kernels_source or source_dir / SOURCE.name
    compiler = compiler or os.environ.get("CC") or "cc"
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise KernelBuildError(f"no C compiler: {compiler!r} is not on PATH (install gcc, or set CC)")
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, check=False).stdout
    # Every C file beside the source (headers included) and the compiler's path: a change to any of them
    # is a different library, never a stale one from the cache.
    others = sorted(path for path in source_dir.glob("*.[ch]") if path.name != SOURCE.name)
    sources = [kernels_source, *others]
    inputs = [
        *(path.read_bytes() for path in sources),
        compiler_path,
        version,
        " ".join(flags),
        quant_layout.compile_definitions(),
        _cpu_signature(),
    ]
    key = hashlib.sha256(repr(inputs).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir() / "kernels"
    target = out_dir / f"kernels-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name and rename: concurrent builders never see a half-written library.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / target.name
        compiled = (kernels_source, source_dir / QUANT_SOURCE.name, source_dir / DECODE_LAYER_SOURCE.name)
        # -I: kernels.h for a kernels.c outside this folder; -D: the quantized layout (quant_layout.py).
        command = [
            compiler_path,
            *flags,
            *quant_layout.compile_definitions(),
            f"-I{source_dir}",
            *map(str, compiled),
            "-o",
            str(partial),
            "-lm",
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KernelBuildError(
                f"`{' '.join(command)}` failed (exit {result.returncode}):\n{result.stderr.strip()}"
            )
        os.replace(partial, target)
    return target


def load_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions' C signatures."""
    # torch is loaded, so the library's libgomp.so.1 resolves to the OpenMP runtime torch already uses:
    # one thread pool, not two competing ones.
    library = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = restype
    return library


class _Library:
    """The loaded library, or why there is none; built on first use, once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self.library: ctypes.CDLL | None = None
        self.unavailable_reason: str | None = None

    def get(self) -> ctypes.CDLL | None:
        if self._loaded:  # the common case, without the lock
            return self.library
        with self._lock:
            if not self._loaded:
                self.library = self._load()
                self._loaded = True
            return self.library

    def _load(self) -> ctypes.CDLL | None:
        if os.environ.get(DISABLE_ENV, "1") == "0":
            self.unavailable_reason = f"{DISABLE_ENV}=0"
            return None
        start = time.perf_counter()
        try:
            path = build_library()
            library = load_library(path)
        except (KernelBuildError, OSError, AttributeError) as e:
            self.unavailable_reason = str(e)
            logger.warning("CPU kernels unavailable, using the PyTorch code instead: %s", e)
            return None
        logger.info("CPU kernels ready (%s, %.1f s)", path, time.perf_counter() - start)
        return library


_LIBRARY = _Library()


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on first call), or None where they are unavailable."""
    return _LIBRARY.get()


def unavailable_reason() -> str | None:
    """Why the kernels are not in use, once `library()` returned None."""
    return _LIBRARY.unavailable_reason


def library_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels, when they are available and can take these tensors (CPU, one supported dtype)."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return None
    for tensor in tensors:  # a plain loop: this runs several times per layer and step
        if tensor.dtype != dtype or not tensor.is_cpu:
            return None
    return library()
