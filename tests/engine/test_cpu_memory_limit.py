"""The cgroup memory limit read as Linux writes it (v2 memory.max, v1 memory.limit_in_bytes, an ancestor's
limit, none), and a CPU engine's KV pool cut to the room that limit leaves (cpu/memory_limit.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from inflight.engine.config import EngineConfig
from inflight.engine.cpu import memory_limit
from inflight.engine.cpu.memory_limit import cgroup_memory_limit, resident_bytes
from inflight.engine.engine import LLMEngine
from inflight.engine.kv_budget import kv_block_bytes, step_activation_bytes

GIB = 2**30


def tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup with `proc` and a cgroup mount under tmp_path/cgroup holding `files`."""
    (tmp_path / "proc-cgroup").write_text(proc)
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    return tmp_path / "proc-cgroup", root


CASES = {
    "v2: the process's cgroup": (
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/ctr/memory.max": f"{8 * GIB}\n", "kubepods/pod1/memory.max": "max\n"},
        8 * GIB,
    ),
    "v2: an ancestor's limit binds": (
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/ctr/memory.max": "max\n", "kubepods/pod1/memory.max": f"{6 * GIB}\n"},
        6 * GIB,
    ),
    "v2: a container with its own cgroup namespace": ("0::/\n", {"memory.max": f"{4 * GIB}\n"}, 4 * GIB),
    "v1: the host's path not visible in the container": (
        "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
        {"memory/memory.limit_in_bytes": f"{2 * GIB}\n"},
        2 * GIB,
    ),
    "v1: no limit": ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),
    "v2: no limit": ("0::/\n", {"memory.max": "max\n"}, None),
}


@pytest.mark.parametrize(("proc", "files", "limit"), CASES.values(), ids=CASES.keys())
def test_limit(tmp_path: Path, proc: str, files: dict[str, str], limit: int | None) -> None:
    assert cgroup_memory_limit(*tree(tmp_path, proc, files)) == limit


def test_no_cgroup_information(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tmp_path / "absent", tmp_path) is None


def test_resident_bytes_are_statm_pages(tmp_path: Path) -> None:
    (tmp_path / "statm").write_text("5000 1234 300 10 0 900 0\n")
    assert resident_bytes(tmp_path / "statm") == 1234 * os.sysconf("SC_PAGE_SIZE")
    assert resident_bytes() > 0


def _engine(model_dir: Path, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(device="cpu", max_num_seqs=4, num_kv_blocks=num_kv_blocks))


def test_a_cpu_engine_cuts_its_kv_pool_to_the_container_limit(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a limit the requested pool; with a limit, the blocks that fit beside the resident memory and
    a step's activations (logged); with none left, an error that says what to change."""
    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: None)
    engine = _engine(tiny_llama_dir, 64)
    assert engine.num_kv_blocks == 64
    config, block_size = engine.model_config, engine.config.block_size
    block = kv_block_bytes(config, engine.model.layout.kv_heads, block_size, engine.kv_dtype)
    dtype = str(engine.dtype).removeprefix("torch.")
    tokens = engine.config.max_num_batched_tokens
    step = step_activation_bytes(
        config.hidden_size, config.intermediate_size, config.vocab_size, tokens, 4, dtype
    )
    engine.close()

    resident = 3 * GIB
    monkeypatch.setattr(memory_limit, "resident_bytes", lambda: resident)
    limit = resident + step + 10 * block + block // 2  # room for 10.5 blocks
    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: limit)
    with caplog.at_level(logging.WARNING, logger="inflight.engine"):
        engine = _engine(tiny_llama_dir, 64)
    assert engine.num_kv_blocks == 10
    assert "64 KV blocks do not fit the container's memory limit" in caplog.text
    engine.close()
    engine = _engine(tiny_llama_dir, 8)  # fits: as asked
    assert engine.num_kv_blocks == 8
    engine.close()

    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: resident + step)
    with pytest.raises(ValueError, match="raise the container's memory limit"):
        _engine(tiny_llama_dir, 64)
