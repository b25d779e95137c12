"""A tensor-parallel CPU engine's KV pool cut to the room its container's memory limit leaves: every rank
lives in that container, so the resident memory of the lead and its worker, each rank's step activations
and each rank's share of a block all count (cpu/memory_limit.py, LLMEngine._plan_num_blocks)."""

from __future__ import annotations

import logging
from pathlib import Path

import psutil
import pytest
import torch

from inflight.engine.config import EngineConfig
from inflight.engine.cpu import memory_limit
from inflight.engine.engine import LLMEngine
from inflight.engine.kv_budget import kv_block_bytes, step_activation_bytes
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.llama import shard_layout

GIB = 2**30
RANKS = 2
LEAD_RESIDENT, WORKER_RESIDENT = 3 * GIB, 1 * GIB


def _engine(model_dir: Path) -> LLMEngine:
    config = EngineConfig(
        device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=64, tensor_parallel_size=RANKS
    )
    return LLMEngine(model_dir, config)


def test_a_tensor_parallel_cpu_engine_cuts_its_kv_pool_to_the_container_limit(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lead reads its worker's resident memory (/proc/PID/statm) beside its own; a block costs both
    ranks' KV heads and a step both ranks' activations (the MLP's share each, full-width residual stream
    and logits): with room for 10.5 such blocks, 10 (logged); with none, an error that says what to do."""
    config = ModelConfig.from_dir(tiny_llama_dir)
    block_size, tokens = EngineConfig().block_size, EngineConfig().max_num_batched_tokens
    layouts = [shard_layout(config, rank, RANKS) for rank in range(RANKS)]
    block = sum(kv_block_bytes(config, layout.kv_heads, block_size, torch.float32) for layout in layouts)
    step = sum(
        step_activation_bytes(
            config.hidden_size, layout.intermediate, config.vocab_size, tokens, 4, "float32"
        )
        for layout in layouts
    )
    read: list[Path] = []
    real_resident_bytes = memory_limit.resident_bytes

    def resident(statm: Path = memory_limit.PROC_STATM) -> int:
        read.append(statm)
        return LEAD_RESIDENT if statm == memory_limit.PROC_STATM else WORKER_RESIDENT

    monkeypatch.setattr(memory_limit, "resident_bytes", resident)
    room = LEAD_RESIDENT + WORKER_RESIDENT + step
    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: room + 10 * block + block // 2)
    with caplog.at_level(logging.WARNING, logger="inflight.engine"):
        engine = _engine(tiny_llama_dir)
    try:
        assert engine.workers is not None
        worker_statm = [Path(f"/proc/{pid}/statm") for pid in engine.workers.pids]
        assert read == [memory_limit.PROC_STATM, *worker_statm]
        assert all(real_resident_bytes(statm) > 0 for statm in worker_statm)
        assert engine.num_kv_blocks == 10
        assert "64 KV blocks do not fit the container's memory limit" in caplog.text
        assert "4.00 GiB resident in the engine's 2 processes" in caplog.text
    finally:
        engine.close()

    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: room + block - 1)
    with pytest.raises(
        ValueError, match=f"one block needs {block} bytes.*raise the container's memory limit"
    ):
        _engine(tiny_llama_dir)
    assert psutil.Process().children(recursive=True) == []
