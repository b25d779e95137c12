"""`inflight generate` on the tiny checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from inflight.bench.vllm_cpu import vllm_env
from inflight.cli import main
from inflight.engine.cpu import openmp


def test_generate_prints_completions_as_json(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = "def main(|import os|--max-tokens|5|--ignore-eos|--json|--num-kv-blocks|32|--device|cpu"
    code = main(["generate", "--model", str(tiny_llama_dir), *args.split("|")])
    assert code == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["prompt"] for line in lines] == ["def main(", "import os"]
    assert all(len(line["completions"][0]["token_ids"]) == 5 for line in lines)
    assert "tokens/s" in captured.err
    # What it is doing while the model loads (seconds to half a minute), on stderr: stdout stays JSON.
    assert f"inflight generate: loading {tiny_llama_dir}" in captured.err
    assert "inflight generate: loaded in " in captured.err and "generating 2 completion(s)" in captured.err


def test_generate_text_output_with_n_and_chat(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = "hi --chat -n 2 --temperature 0.8 --seed 1 --max-tokens 3 --num-kv-blocks 32 --device cpu"
    code = main(["generate", "--model", str(tiny_llama_dir), *args.split()])
    assert code == 0
    out = capsys.readouterr().out
    assert "--- prompt 0:" in out and "<|im_start|>" in out and "[1] " in out


def test_generate_reports_bad_input_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path / "missing"), "x"]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, {"GOMP_SPINCOUNT": openmp.SPIN_COUNT, "INFLIGHT_OPENMP_SPIN_CHOSEN": openmp.SPIN_COUNT}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"GOMP_SPINCOUNT": "0"}, {"GOMP_SPINCOUNT": "0"}),
    ],
)
def test_openmp_spins_briefly_unless_user_chose(environ: dict[str, str], expected: dict[str, str]) -> None:
    openmp.configure(environ)
    assert environ == expected


def test_other_systems_get_the_users_openmp_setting_not_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM-CPU and llama-server in a benchmark run as their users run them: the spin count the engine
    chose is taken out (also in a process started from the one that chose it), the user's kept."""
    chosen = {"PATH": "/bin"}
    openmp.configure(chosen)
    child = dict(chosen)
    openmp.configure(child)  # a server the benchmark starts runs `inflight` again
    assert openmp.environment_without_engine_choice(chosen) == {"PATH": "/bin"}
    assert openmp.environment_without_engine_choice(child) == {"PATH": "/bin"}
    users = {"PATH": "/bin", "GOMP_SPINCOUNT": "500"}
    openmp.configure(users)
    assert openmp.environment_without_engine_choice(users) == users
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "INFLIGHT_OPENMP_SPIN_CHOSEN"):
        monkeypatch.delenv(name, raising=False)
    openmp.configure(os.environ)
    assert os.environ["GOMP_SPINCOUNT"] == openmp.SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in vllm_env(Path("/tmp/x"), 2)
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    assert vllm_env(Path("/tmp/x"), 2)["GOMP_SPINCOUNT"] == "500"
