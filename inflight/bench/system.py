"""What every benchmarked system provides, and what one run of it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.bench.workload import BenchRequest
from inflight.engine.dtypes import DTypeName


@dataclass(frozen=True)
class BenchSettings:
    model_dir: Path
    requests: list[BenchRequest]
    # Most requests in flight at once, for every system that batches.
    max_slots: int
    dtype: DTypeName
    vllm_python: Path | None
    max_num_batched_tokens: int
    # torch intra-op threads for the in-process systems; vLLM's OpenMP threads are bound to as many cores.
    # None: torch's default (all cores).
    threads: int | None = None
    # Ranks of the inflight engines (tensor parallelism); the other systems run unsplit.
    tensor_parallel_size: int = 1
    # The inflight engines' KV cache element type (auto or fp8; --kv-cache-dtype).
    kv_cache_dtype: str = "auto"
    # inflight's weight format (engine/quantization.py) and the checkpoint its systems read (the GGUF
    # file when its weights stay quantized; None: model_dir, like every other system).
    quantization: str = "auto"
    inflight_model: Path | None = None


def resident_mib(pid: int | str = "self") -> float | None:
    """Resident memory (VmRSS) of process `pid` in MiB; None where /proc has no answer."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class SystemRun:
    # Generated token ids per request, in workload order.
    outputs: list[list[int]]
    # Wall time of the timed region: from the first request submitted to the last token out.
    seconds: float
    # Model load and warm-up (not counted in tokens/s).
    setup_seconds: float
    # The system's own knobs as run (batch sizes, block counts), for the JSON report.
    config: dict[str, Any] = field(default_factory=dict)
    # CPU time of this process's threads in the timed region (None: not measured). On a machine shared
    # with other jobs, output tokens per CPU second moves far less with their load than tokens/s does.
    cpu_seconds: float | None = None


@dataclass(frozen=True)
class System:
    name: str
    description: str
    # None when the system can run here, else why not (what to install).
    unavailable: Callable[[BenchSettings], str | None]
    run: Callable[[BenchSettings], SystemRun]
    # Whether it constrains the requests that carry a JSON schema (BenchRequest.schema).
    takes_schemas: bool = False
