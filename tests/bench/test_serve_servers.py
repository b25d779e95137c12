"""`inflight bench serve --servers`: when the servers do not fit in memory together, each runs alone.

The runs here start real processes, stand-ins for the servers (tests/support/fake_completion_server.py):
ready in a fraction of a second, each records how many other servers are alive at every request it serves.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from inflight.bench import served, vllm_cpu
from inflight.bench.served import ServedSystem, choose_servers, memory_needs
from inflight.cli import build_parser
from inflight.engine.model.config import ModelConfig
from inflight.sizing import GIB, MODEL_CATALOG, shape_of_config

FAKE_SERVER = Path(__file__).parents[1] / "support" / "fake_completion_server.py"


def test_auto_runs_the_servers_one_at_a_time_when_together_they_pass_the_memory_available() -> None:
    needs = {"inflight": 12 * GIB, "vllm": 10 * GIB}
    mode, why = choose_servers("auto", needs, 24 * GIB)
    assert mode == "one-at-a-time"
    assert why.startswith("about 22.0 GiB together (inflight 12.0 GiB, vllm 10.0 GiB), more than 90% of the ")
    assert "24.0 GiB available" in why
    # Within 90% of what is available: together. 90% of 25 GiB is 22.5 GiB.
    assert choose_servers("auto", needs, 25 * GIB)[0] == "together"
    assert choose_servers("auto", needs, None)[0] == "together"  # unknown: as before
    # A server that does not fit even alone is named.
    assert "even alone, inflight needs more" in choose_servers("auto", needs, 13 * GIB)[1]
    # The flag decides when given; one server and no offline engine have nothing to alternate with.
    assert choose_servers("together", needs, 1 * GIB)[0] == "together"
    assert choose_servers("one-at-a-time", needs, 100 * GIB)[0] == "one-at-a-time"
    assert choose_servers("auto", {"inflight": 12 * GIB}, 1 * GIB)[0] == "together"


def test_the_vllm_estimate_covers_what_its_server_was_measured_to_hold() -> None:
    # SmolLM2 float32 served by vLLM-CPU with its 4 GiB of KV cache: 7.3-7.7 GiB of RSS over its three
    # processes (5 December). One runtime's allowance instead of three had put it at 5.5 GiB, and `auto`
    # ran both servers together at 93 % of the memory available.
    smollm2 = MODEL_CATALOG["builtin:smollm2"]
    assert 7.3 * GIB <= vllm_cpu.memory_bytes(smollm2, "float32") <= 8 * GIB


def test_the_estimates_count_every_server_and_the_offline_engine(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    args = build_parser().parse_args(["bench", "serve", "--dtype", "float32"])
    shape = shape_of_config("tiny", ModelConfig.from_dir(tiny_llama_dir))
    few = memory_needs(args, tiny_llama_dir, ["vllm"], None, longest=100, num_kv_blocks=10)
    many = memory_needs(args, tiny_llama_dir, ["vllm"], None, longest=100, num_kv_blocks=20)
    assert list(few) == ["inflight", "vllm", "offline engine"]
    assert few["offline engine"] == few["inflight"]
    assert few["vllm"] == vllm_cpu.memory_bytes(shape, "float32")
    # The KV pool: 10 blocks of 16 tokens, each token K and V over every layer in float32.
    token_bytes = 2 * shape.num_layers * shape.num_key_value_heads * shape.head_dim * 4
    assert many["inflight"] - few["inflight"] == 10 * 16 * token_bytes
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"0" * 1000)
    args = build_parser().parse_args(
        ["bench", "serve", "--skip-offline", "--max-slots", "2", "--dtype", "float32"]
    )
    needs = memory_needs(args, tiny_llama_dir, ["llama-cpp"], gguf, longest=100, num_kv_blocks=10)
    assert list(needs) == ["inflight", "llama-cpp"]
    # The file and a float16 KV cache for llama-server's context: 2 slots of 100 tokens.
    assert needs["llama-cpp"] == 1000 + 2 * 100 * token_bytes // 2


def fake_system(name: str, folder: Path, ready_path: str) -> ServedSystem:
    def command(port: int) -> list[str]:
        return [sys.executable, str(FAKE_SERVER), name, str(port), str(folder)]

    return ServedSystem(name, "", "bench", ready_path, command, dict(os.environ))


def run_bench(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, folder: Path, *flags: str, vllm: Any = None
) -> tuple[int, list[list[str]]]:
    """`inflight bench serve --compare vllm` against two stand-in servers; the exit code and the log."""
    monkeypatch.setattr(served, "inflight_system", lambda *_: fake_system("inflight", folder, "/ready"))
    monkeypatch.setattr(served, "vllm_system", vllm or (lambda *_: fake_system("vllm", folder, "/health")))
    args = build_parser().parse_args(
        ["bench", "serve", "--model", str(model_dir), "--compare", "vllm", "--vllm-python", sys.executable,
         "--num-requests", "2", "--request-rate", "inf", "--skip-offline", "--out", str(folder / "out"),
         *flags]
    )  # fmt: skip
    try:
        code = served.run_serve_benchmark(args)
    finally:
        log = [line.split() for line in (folder / "log").read_text().splitlines()]
        left = [
            int(pid) for _, event, pid in log if event == "start" and served.process_group_alive(int(pid))
        ]
        for pgid in left:
            os.killpg(pgid, signal.SIGKILL)
        assert not left, f"servers {left} outlived the benchmark"
    return code, log


def test_one_at_a_time_no_two_servers_are_alive_together(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, log = run_bench(
        monkeypatch, tiny_llama_dir, tmp_path, "--servers", "one-at-a-time", "--rounds", "3"
    )
    assert code == 0
    requests = [entry for entry in log if entry[1] == "request"]
    assert requests and all(others == "0" for _, _, others in requests)
    # Each round's turns alternate, the server still up from the last turn going first: three rounds, four
    # starts (inflight, vllm | vllm, inflight | inflight, vllm).
    starts = [name for name, event, _ in log if event == "start"]
    assert starts == ["inflight", "vllm", "inflight", "vllm"]
    # Requests per turn: after a start its two warm-up requests, then the workload's two.
    turns = [name for name, _, _ in requests]
    assert (
        turns
        == ["inflight"] * 4 + ["vllm"] * 4 + ["vllm"] * 2 + ["inflight"] * 4 + ["inflight"] * 2 + ["vllm"] * 4
    )
    report = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert report["servers"]["mode"] == "one-at-a-time" and report["servers"]["requested"] == "one-at-a-time"
    assert set(report["servers"]["estimated_gib"]) == {"inflight", "vllm"}
    for system in ("inflight", "vllm"):
        assert len(report["systems"][system]["rounds_output_tokens_per_s"]) == 3


@pytest.mark.parametrize(("available_gib", "mode"), [(2, "one-at-a-time"), (1000, "together")])
def test_auto_decides_from_the_memory_available(
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    available_gib: int,
    mode: str,
) -> None:
    """vLLM-CPU alone is given 4 GiB of KV cache: on 2 GiB the servers run one at a time. Together, each
    round's requests find the other server alive (paused): the log tells the modes apart."""
    monkeypatch.setattr(served, "available_memory_bytes", lambda: available_gib * GIB)
    code, log = run_bench(monkeypatch, tiny_llama_dir, tmp_path)
    assert code == 0
    for system in ("inflight", "vllm"):
        # Two warm-up requests (together: the other server may not be up yet), then the round's two.
        others = [entry[2] for entry in log if entry[:2] == [system, "request"]]
        assert len(others) == 4
        assert set(others if mode == "one-at-a-time" else others[2:]) == {
            "0" if mode == "one-at-a-time" else "1"
        }
    assert f"bench serve: servers {mode}: about " in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert report["servers"]["mode"] == mode and report["servers"]["available_gib"] == available_gib


def test_a_server_that_does_not_start_ends_the_run_with_its_message_and_no_server_left(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def exits_at_once(*_: Any) -> ServedSystem:
        return ServedSystem(
            "vllm", "", "bench", "/health", lambda port: [sys.executable, "-c", "raise SystemExit(3)"]
        )

    with pytest.raises(SystemExit, match="the vllm server exited with code 3 before it was ready"):
        run_bench(monkeypatch, tiny_llama_dir, tmp_path, "--servers", "one-at-a-time", vllm=exits_at_once)


@pytest.mark.parametrize("mode", ["one-at-a-time", "together"])
@pytest.mark.parametrize("interrupt", ["ctrl-c", "sigterm"])
def test_an_interrupted_run_stops_every_server(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, interrupt: str
) -> None:
    def interrupted(*_: Any) -> None:
        if interrupt == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)

    def unhandled(*_: Any) -> None:
        raise AssertionError("the benchmark left SIGTERM to the handler it found")

    monkeypatch.setattr(served, "summarize", interrupted)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(KeyboardInterrupt if interrupt == "ctrl-c" else SystemExit):
            run_bench(monkeypatch, tiny_llama_dir, tmp_path, "--servers", mode)  # no server outlives it
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the benchmark put it back
    finally:
        signal.signal(signal.SIGTERM, before)
