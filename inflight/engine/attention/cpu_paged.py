"""Paged attention on CPU: decode rows through a small C kernel that reads K/V blocks where they lie.

The torch path (torch_paged.py) gathers every decode sequence's blocks into a contiguous buffer and then
runs SDPA over it: on CPU that is two trips through memory for every key and value, and the gather alone
was a third of attention's time. `cpu_kernels.c` scores, softmaxes and sums straight from the blocks, one
work item per (sequence, KV head) over torch's threads. Prefill and chunked-prefill sequences keep the
torch path (one SDPA each, where SDPA is at its best).

The kernel is compiled at first use with the system C compiler (`$CC`, else `cc`) into
$INFLIGHT_CACHE_DIR/kernels (default ~/.cache/inflight/kernels), keyed by the source, the compiler and
the CPU, so it is built once per machine type. Where there is no compiler, the build fails, or
INFLIGHT_CPU_KERNELS=0, the engine logs why and uses the torch path: same results, slower.
float32 and bfloat16 use the kernel; float16 and non-contiguous inputs use the torch path.
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
from collections.abc import Callable
from pathlib import Path

import torch

from inflight.cache import cache_dir
from inflight.engine.attention import torch_paged
from inflight.engine.attention.metadata import AttentionMetadata

logger = logging.getLogger("inflight.engine")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
DISABLE_ENV = "INFLIGHT_CPU_KERNELS"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_c_int64 = ctypes.c_int64
_ARGTYPES: list[type[ctypes.c_void_p | ctypes.c_int64 | ctypes.c_float | ctypes.c_int]] = [
    ctypes.c_void_p,  # q
    ctypes.c_void_p,  # k_cache
    ctypes.c_void_p,  # v_cache
    ctypes.c_void_p,  # block_tables (int32)
    _c_int64,  # table_stride
    ctypes.c_void_p,  # seq_lens (int32)
    ctypes.c_void_p,  # rows (int64)
    ctypes.c_void_p,  # seqs (int64)
    _c_int64,  # n
    _c_int64,  # num_heads
    _c_int64,  # num_kv_heads
    _c_int64,  # head_dim
    _c_int64,  # block_size
    _c_int64,  # window
    ctypes.c_float,  # scale
    ctypes.c_int,  # dtype
    ctypes.c_void_p,  # out
    _c_int64,  # max_seq_len
    ctypes.c_int,  # num_threads
]


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


def build_library(compiler: str | None = None, out_dir: Path | None = None) -> Path:
    """Compile cpu_kernels.c (once per source, compiler and CPU) and return the shared library's path."""
    compiler = compiler or os.environ.get("CC") or "cc"
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise KernelBuildError(f"no C compiler: {compiler!r} is not on PATH (install gcc, or set CC)")
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, check=False).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, version.encode(), " ".join(COMPILE_FLAGS).encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    out_dir = out_dir or cache_dir() / "kernels"
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name and rename: concurrent builders never see a half-written library.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / target.name
        command = [compiler_path, *COMPILE_FLAGS, str(SOURCE), "-o", str(partial), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KernelBuildError(
                f"`{' '.join(command)}` failed (exit {result.returncode}):\n{result.stderr.strip()}"
            )
        os.replace(partial, target)
    return target


class _Library:
    """The loaded kernel library, or why there is none; built on first use, once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self._decode: Callable[..., int] | None = None
        self.unavailable_reason: str | None = None

    def decode_function(self) -> Callable[..., int] | None:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                self._decode = self._load()
            return self._decode

    def _load(self) -> Callable[..., int] | None:
        if os.environ.get(DISABLE_ENV, "1") == "0":
            self.unavailable_reason = f"{DISABLE_ENV}=0"
            return None
        start = time.perf_counter()
        try:
            path = build_library()
            # torch is loaded, so the library's libgomp.so.1 resolves to the OpenMP runtime torch already
            # uses: one thread pool, not two competing ones.
            function = ctypes.CDLL(str(path)).paged_decode
        except (KernelBuildError, OSError, AttributeError) as e:
            self.unavailable_reason = str(e)
            logger.warning("CPU paged-attention kernel unavailable, using the torch path: %s", e)
            return None
        function.argtypes = _ARGTYPES
        function.restype = ctypes.c_int
        logger.info("CPU paged-attention kernel ready (%s, %.1f s)", path, time.perf_counter() - start)
        return function


_LIBRARY = _Library()


def kernel_available() -> bool:
    """True when the C kernel is built and loaded (builds it on first call)."""
    return _LIBRARY.decode_function() is not None


def unavailable_reason() -> str | None:
    """Why the kernel is not in use, once `kernel_available()` returned False."""
    return _LIBRARY.unavailable_reason


def _kernel_handles(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPE_CODES
        and k_cache.dtype == v_cache.dtype == query.dtype
        and query.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as torch_paged.paged_attention; decode rows go through the C kernel."""
    decode = _LIBRARY.decode_function()
    if decode is None or not _kernel_handles(query, k_cache, v_cache):
        return torch_paged.paged_attention(query, k_cache, v_cache, meta, scale)
    out = torch.empty_like(query)
    if meta.is_decode_only:
        seqs = list(range(meta.num_seqs))
        rows = seqs
    else:
        seqs, rows = torch_paged.attend_prefills(out, query, k_cache, v_cache, meta, scale)
        if not seqs:
            return out
    block_tables = meta.block_tables.to(torch.int32).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    rows_tensor = torch.tensor(rows, dtype=torch.int64)
    seqs_tensor = rows_tensor if rows is seqs else torch.tensor(seqs, dtype=torch.int64)
    failed = decode(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        rows_tensor.data_ptr(),
        seqs_tensor.data_ptr(),
        len(seqs),
        query.shape[1],
        k_cache.shape[2],
        query.shape[2],
        k_cache.shape[1],
        meta.sliding_window or 0,
        scale,
        DTYPE_CODES[query.dtype],
        out.data_ptr(),
        max(meta.seq_lens_list[i] for i in seqs),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("CPU paged attention: could not allocate the kernel's scratch memory")
    return out
