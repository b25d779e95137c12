"""`inflight generate` on the tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.cli import OPENMP_SPIN_COUNT, configure_openmp, main


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
        ({}, {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"GOMP_SPINCOUNT": "0"}, {"GOMP_SPINCOUNT": "0"}),
    ],
)
def test_openmp_spins_briefly_unless_user_chose(environ: dict[str, str], expected: dict[str, str]) -> None:
    configure_openmp(environ)
    assert environ == expected
