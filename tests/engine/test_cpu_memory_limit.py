"""The cgroup memory limit read as Linux writes it (v2 memory.max, v1 memory.limit_in_bytes, an ancestor's
limit, none), the machine's available memory (MemAvailable), and a CPU engine's KV pool cut to the room
the smaller of the two leaves (cpu/memory_limit.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from inflight.engine.config import EngineConfig
from inflight.engine.cpu import memory_limit
from inflight.engine.cpu.memory_limit import available_memory_bytes, cgroup_memory_limit, resident_bytes
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


def test_the_memory_available_is_the_kernels_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683792 kB\nMemFree: 100 kB\nMemAvailable:   20855052 kB\n")
    assert available_memory_bytes(meminfo) == 20855052 * 1024
    assert available_memory_bytes(tmp_path / "missing") is None
    (tmp_path / "old").write_text("MemTotal:       24683792 kB\nMemFree: 100 kB\n")  # before Linux 3.14
    assert available_memory_bytes(tmp_path / "old") is None


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
    monkeypatch.setattr(memory_limit, "available_memory_bytes", lambda: None)
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


def test_a_cpu_engine_cuts_its_kv_pool_to_the_machines_available_memory(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where no container limit binds (a VM, bare metal, a benchmark run), a pool past the machine's
    available memory is cut to what fits beside a step's activations (logged), as a container's limit cuts
    it; with both, the smaller room binds; with no room, an error that says what to change. The pool itself
    is allocated after the plan, so MemAvailable, read then, already leaves out the loaded weights."""
    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: None)
    monkeypatch.setattr(memory_limit, "available_memory_bytes", lambda: None)
    engine = _engine(tiny_llama_dir, 8)
    config = engine.model_config
    block = kv_block_bytes(config, engine.model.layout.kv_heads, engine.config.block_size, engine.kv_dtype)
    step = step_activation_bytes(
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
        engine.config.max_num_batched_tokens,
        4,
        str(engine.dtype).removeprefix("torch."),
    )
    engine.close()

    monkeypatch.setattr(memory_limit, "available_memory_bytes", lambda: step + 6 * block + block // 2)
    with caplog.at_level(logging.WARNING, logger="inflight.engine"):
        engine = _engine(tiny_llama_dir, 64)
    assert engine.num_kv_blocks == 6
    assert "64 KV blocks do not fit the machine's available memory of" in caplog.text
    assert "(MemAvailable)" in caplog.text
    engine.close()

    resident = 1 * GIB
    monkeypatch.setattr(memory_limit, "resident_bytes", lambda: resident)
    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: resident + step + 10 * block)
    engine = _engine(tiny_llama_dir, 64)
    assert engine.num_kv_blocks == 6  # the machine's room (6.5 blocks) is the smaller
    engine.close()
    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: resident + step + 3 * block)
    engine = _engine(tiny_llama_dir, 64)
    assert engine.num_kv_blocks == 3  # the container's (3 blocks)
    engine.close()

    monkeypatch.setattr(memory_limit, "cgroup_memory_limit", lambda: None)
    monkeypatch.setattr(memory_limit, "available_memory_bytes", lambda: step + block - 1)
    with pytest.raises(ValueError, match=r"machine's available memory.*free memory on the machine"):
        _engine(tiny_llama_dir, 64)
