"""The offline benchmark harness: skipping, validation, ratios, outputs, and real systems on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.bench import inflight_engine, offline
from inflight.bench.system import BenchSettings, System, SystemRun
from inflight.bench.workload import (
    BenchRequest,
    load_workload,
    make_workload,
    vocab_size,
    with_sampling,
    with_schemas,
)
from inflight.cli.bench import run_offline_command
from inflight.engine.tokenizer import Tokenizer


def settings_for(requests: list[BenchRequest], model_dir: Path = Path("unused")) -> BenchSettings:
    return BenchSettings(
        model_dir=model_dir,
        requests=requests,
        max_slots=4,
        dtype="float32",
        vllm_python=None,
        max_num_batched_tokens=256,
        threads=1,
    )


def fake(name: str, seconds: float, *, short_by: int = 0, error: str = "", missing: str = "") -> System:
    def run(settings: BenchSettings) -> SystemRun:
        if error:
            raise RuntimeError(error)
        outputs = [[7] * r.output_len for r in settings.requests]
        outputs[0] = outputs[0][: len(outputs[0]) - short_by]
        return SystemRun(outputs, seconds, 0.5)

    return System(name, f"fake {name}", lambda _settings: missing or None, run)


def test_ratios_validation_skips_and_failures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    systems = {
        "hf-naive": fake("hf-naive", 8.0),
        "hf-static": fake("hf-static", 1.0, short_by=1),
        "hf-continuous": fake("hf-continuous", 1.0, error="boom"),
        "vllm": fake("vllm", 1.0, missing="not installed"),
        "inflight-continuous": fake("inflight-continuous", 2.0),
    }
    monkeypatch.setattr(offline, "SYSTEMS", systems)
    requests = make_workload(vocab=100, excluded_ids=set(), num_requests=3, output_lengths=(4, 6))
    report = offline.run_offline(list(systems), settings_for(requests), lambda _message: None)

    status = {r.name: r.status for r in report.results}
    assert status == {
        "hf-naive": "ok",
        "hf-static": "invalid",
        "hf-continuous": "failed",
        "vllm": "skipped",
        "inflight-continuous": "ok",
    }
    assert report.ratios == {"inflight-continuous/hf-naive": pytest.approx(4.0)}
    naive = report.results[0]
    assert naive.generated_tokens == sum(r.output_len for r in requests)
    assert naive.identical_to_reference == 3

    paths = offline.write_outputs(report, tmp_path)
    assert [p.name for p in paths] == ["offline.json", "offline.txt", "offline.png"]
    saved = json.loads((tmp_path / "offline.json").read_text())
    assert saved["ratios"]["inflight-continuous/hf-naive"] == pytest.approx(4.0)
    assert (tmp_path / "offline.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "offline.txt").read_text()
    assert "4.00x" in table and "not installed" in table and "boom" in table


def test_rounds_alternate_and_report_the_median_round(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []

    def timed(name: str, seconds: list[float]) -> System:
        times = iter(seconds)

        def run(settings: BenchSettings) -> SystemRun:
            calls.append(name)
            return SystemRun([[7] * r.output_len for r in settings.requests], next(times), 0.5)

        return System(name, f"fake {name}", lambda _settings: None, run)

    systems = {
        "vllm": timed("vllm", [2.0, 1.0, 4.0]),
        "hf-naive": fake("hf-naive", 1.0, missing="not installed"),
        "inflight-continuous": timed("inflight-continuous", [0.5, 1.0, 1.0]),
    }
    monkeypatch.setattr(offline, "SYSTEMS", systems)
    requests = make_workload(vocab=100, excluded_ids=set(), num_requests=2, output_lengths=(5, 5))
    report = offline.run_offline(list(systems), settings_for(requests), lambda _message: None, rounds=3)

    # every other round runs the systems in reverse order; a skipped system is not retried
    assert calls == [
        "vllm",
        "inflight-continuous",
        "inflight-continuous",
        "vllm",
        "vllm",
        "inflight-continuous",
    ]
    by_name = {r.name: r for r in report.results}
    assert by_name["hf-naive"].status == "skipped"
    tokens = 10
    assert by_name["vllm"].rounds_tokens_per_s == [tokens / 2.0, tokens / 1.0, tokens / 4.0]
    assert by_name["vllm"].tokens_per_s == tokens / 2.0  # the median round
    assert by_name["inflight-continuous"].tokens_per_s == tokens / 1.0
    assert report.round_ratios == {"inflight-continuous/vllm": pytest.approx([4.0, 1.0, 4.0])}
    # the median of the rounds' ratios (4x), not the ratio of the median rounds (2x)
    assert report.ratios == {"inflight-continuous/vllm": pytest.approx(4.0)}
    offline.write_outputs(report, tmp_path)
    table = (tmp_path / "offline.txt").read_text()
    assert "inflight-continuous/vllm by round: 4.00x, 1.00x, 4.00x" in table and "4.00x\n" in table
    assert json.loads((tmp_path / "offline.json").read_text())["workload"]["rounds"] == 3


def test_vllm_without_an_environment_is_skipped_with_the_fix() -> None:
    from inflight.bench.vllm_cpu import SYSTEM

    requests = make_workload(vocab=100, excluded_ids=set(), num_requests=1)
    reason = SYSTEM.unavailable(settings_for(requests))
    assert reason is not None and "make bench-vllm" in reason


def test_cli_rejects_unknown_systems() -> None:
    from inflight.cli import build_parser

    args = build_parser().parse_args(["bench", "offline", "--compare", "hf-naive,bogus"])
    with pytest.raises(SystemExit, match="bogus"):
        run_offline_command(args)


def test_cli_rejects_zero_rounds() -> None:
    from inflight.cli import build_parser

    command = ["bench", "offline", "--compare", "inflight-continuous", "--rounds", "0"]
    args = build_parser().parse_args(command)
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        run_offline_command(args)


def test_real_systems_agree_token_for_token_on_a_tiny_model(tiny_llama_dir: Path) -> None:
    """transformers (one at a time, padded batches, its continuous batching) and both inflight schedulers
    run the harness end to end and produce the same greedy tokens with the exact requested lengths."""
    requests = [
        BenchRequest(r.prompt_token_ids[:12], r.output_len % 7 + 3) for r in load_workload(tiny_llama_dir, 3)
    ]
    names = ["hf-naive", "hf-static", "hf-continuous", "inflight-static", "inflight-continuous"]
    report = offline.run_offline(names, settings_for(requests, tiny_llama_dir), lambda _message: None)
    for result in report.results:
        assert result.status == "ok", (result.name, result.message)
        assert result.identical_to_reference == len(requests), result.name
        assert result.tokens_per_s > 0
    assert set(report.ratios) == {f"inflight-continuous/{name}" for name in names[:-1]}


def test_end_of_sequence_is_an_ordinary_token_for_every_system(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`ignore_eos` semantics throughout: a model whose first choice is its end-of-sequence token at every
    step makes every system generate that token to the end. (transformers' min_new_tokens forbids EOS
    until the length instead, and then picks another token wherever the model ranks EOS first.)"""
    model_dir = tmp_path / "eos-first"
    shutil.copytree(tiny_llama_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])  # every logit 0: id 0 wins
    save_file(weights, model_dir / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model_dir / name).read_text())
        config["eos_token_id"] = 0
        (model_dir / name).write_text(json.dumps(config))
    requests = [BenchRequest(r.prompt_token_ids[:8], 5) for r in load_workload(model_dir, 2)]
    names = ["hf-naive", "hf-static", "hf-continuous", "inflight-continuous"]
    report = offline.run_offline(names, settings_for(requests, model_dir), lambda _message: None)
    for result in report.results:
        assert result.status == "ok", (result.name, result.message)
        assert result.identical_to_reference == len(requests), result.name


def test_a_schema_share_constrains_inflight_and_skips_systems_that_cannot(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    runs: list[SystemRun] = []

    def recorded(settings: BenchSettings) -> SystemRun:
        runs.append(inflight_engine.CONTINUOUS.run(settings))
        return runs[-1]

    ours = dataclasses.replace(inflight_engine.CONTINUOUS, run=recorded)
    systems = {"hf-naive": fake("hf-naive", 1.0), "inflight-continuous": ours}
    monkeypatch.setattr(offline, "SYSTEMS", systems)
    plain = make_workload(vocab_size(tiny_llama_dir), set(), num_requests=4, output_lengths=(8, 24))
    settings = settings_for(with_schemas(plain, 0.5), tiny_llama_dir)
    report = offline.run_offline(list(systems), settings, lambda _message: None)
    assert {r.name: r.status for r in report.results} == {"hf-naive": "skipped", "inflight-continuous": "ok"}
    assert report.workload["requests_with_schema"] == 2
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    texts = [tokenizer.decode(tokens) for tokens in runs[0].outputs]
    # Every request generated its exact length (the schema cannot end sooner); constrained ones are JSON.
    assert [texts[i].startswith('[{"name": "') for i in range(4)] == [False, True, False, True]


def test_the_engines_run_samples_as_its_requests_ask(tiny_llama_dir: Path) -> None:
    """`bench serve --temperature` also samples in its offline run: the same exact lengths, other tokens
    than greedy (on the random tiny model no token is likely enough to repeat greedy's 4 x 12 tokens)."""
    greedy = [BenchRequest(r.prompt_token_ids[:12], 12) for r in load_workload(tiny_llama_dir, 4)]
    runs = [
        inflight_engine.CONTINUOUS.run(settings_for(requests, tiny_llama_dir))
        for requests in (greedy, greedy, with_sampling(greedy, 1.0, 0.95))
    ]
    assert [[len(tokens) for tokens in run.outputs] for run in runs] == [[12] * 4] * 3
    assert runs[0].outputs == runs[1].outputs
    assert runs[2].outputs != runs[0].outputs
