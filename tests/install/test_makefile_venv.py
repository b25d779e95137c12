"""`make venv` (what `make demo` and `make test` run first) says what it is doing at each step, shows pip's
progress for torch, and takes torch from the index named by TORCH_INDEX_URL, as the README says."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def venv_recipe(*variables: str) -> list[str]:
    """The commands `make venv` would run on a fresh clone (a dry run: nothing is installed)."""
    run = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "venv", *variables],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout.splitlines()


def test_each_install_step_is_announced_and_torch_shows_its_progress() -> None:
    lines = venv_recipe()
    installs = [i for i, line in enumerate(lines) if " -m pip install " in line]
    assert len(installs) == 3
    for i in installs:
        assert lines[i - 1].startswith('echo "make venv: ['), lines[i - 1]
    torch = next(line for line in lines if "torch==" in line and " -m pip install " in line)
    assert " -q" not in torch and "--progress-bar on" in torch and "--index-url" not in torch


def test_torch_index_url_picks_the_wheel_index() -> None:
    cpu = "https://download.pytorch.org/whl/cpu"
    torch = next(
        line for line in venv_recipe(f"TORCH_INDEX_URL={cpu}") if "torch==" in line and "pip" in line
    )
    assert f"--index-url {cpu} " in torch
    assert f"TORCH_INDEX_URL={cpu}" in (REPO / "README.md").read_text()
