"""The cgroup CPU limit read as Linux writes it (v2 cpu.max, v1 CFS quota, an ancestor's limit, a container
that sees only its own cgroup), and the engine's threads fitted to it."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inflight.engine.config import EngineConfig
from inflight.engine.cpu import cpu_limit
from inflight.engine.cpu.cpu_limit import cgroup_cpu_limit, fit_threads_to_cpu_limit, threads_for_limit
from inflight.engine.engine import LLMEngine
from inflight.engine.guided import mask_threads


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup with `proc` and a cgroup mount under tmp_path/cgroup holding `files`."""
    write(tmp_path / "proc-cgroup", proc)
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        write(root / name, text)
    return tmp_path / "proc-cgroup", root


CASES = {
    "v2: the process's cgroup": (
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/ctr/cpu.max": "250000 100000\n", "kubepods/pod1/cpu.max": "max 100000\n"},
        2.5,
    ),
    "v2: an ancestor's limit binds": (
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/ctr/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "150000 100000\n"},
        1.5,
    ),
    "v2: a container with its own cgroup namespace": ("0::/\n", {"cpu.max": "400000 100000\n"}, 4.0),
    "v1: the host's path not visible in the container": (
        "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
        0.5,
    ),
}


@pytest.mark.parametrize(("proc", "files", "cpus"), CASES.values(), ids=CASES.keys())
def test_limit(tmp_path: Path, proc: str, files: dict[str, str], cpus: float) -> None:
    assert cgroup_cpu_limit(*tree(tmp_path, proc, files)) == cpus


def test_no_limit(tmp_path: Path) -> None:
    proc, root = tree(
        tmp_path,
        "1:cpu:/\n0::/\n",
        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n", "cpu.max": "max 100000\n"},
    )
    assert cgroup_cpu_limit(proc, root) is None
    assert cgroup_cpu_limit(tmp_path / "absent", root) is None


def test_threads_are_whole_cpus_at_least_one() -> None:
    assert [threads_for_limit(x) for x in (0.25, 1.0, 1.9, 2.5, 16.0)] == [1, 1, 1, 2, 16]


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_cpu_limit(monkeypatch: pytest.MonkeyPatch, restore_threads: None) -> None:
    """A 1-CPU cgroup limit on a process that may run on two CPUs with two torch threads."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_limit, "cgroup_cpu_limit", lambda: 1.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)


def test_threads_lowered_to_the_limit(one_cpu_limit: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="inflight.engine"):
        fit_threads_to_cpu_limit()
    assert torch.get_num_threads() == 1
    assert "OMP_NUM_THREADS" in caplog.text
    assert mask_threads() == 1  # no CPU left free under the limit: llguidance gets its minimum


def test_omp_num_threads_wins(one_cpu_limit: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    fit_threads_to_cpu_limit()
    assert torch.get_num_threads() == 2


def test_no_limit_leaves_threads(restore_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_limit, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)
    fit_threads_to_cpu_limit()
    assert torch.get_num_threads() == 2


def test_a_cpu_engine_fits_its_threads(one_cpu_limit: None, tiny_llama_dir: Path) -> None:
    engine = LLMEngine(tiny_llama_dir, EngineConfig(device="cpu", max_num_seqs=2))
    try:
        assert torch.get_num_threads() == 1
    finally:
        engine.close()
