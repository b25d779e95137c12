"""The engine's flags are one set: the same options in serve, generate, demo and bench serve, and their
defaults are EngineConfig's."""

from __future__ import annotations

import argparse

import pytest

from inflight.cli import build_parser
from inflight.engine.cli_args import add_engine_args, engine_config_from_args
from inflight.engine.config import (
    CPU_MIN_PREFILL_TOKENS_WHILE_DECODING,
    CPU_PREFILL_TOKENS_WHILE_DECODING,
    CPU_PREFILL_WORK_WHILE_DECODING,
    EngineConfig,
    cpu_prefill_tokens_while_decoding,
)
from inflight.sizing import find_model

COMMANDS = {
    "serve": ["serve", "--model", "m"],
    "generate": ["generate", "--model", "m", "prompt"],
    "demo": ["demo"],
    "bench serve": ["bench", "serve"],
}


def _engine_options() -> set[str]:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    for word in words:
        choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        parser = choices[word]
    return parser


@pytest.mark.parametrize("command", ["serve", "generate", "demo"])
def test_the_engine_flags_default_to_engine_config(command: str) -> None:
    args = build_parser().parse_args(COMMANDS[command])
    assert engine_config_from_args(args) == EngineConfig()


def test_every_engine_command_takes_the_same_engine_flags() -> None:
    parser = build_parser()
    engine = _engine_options()
    assert {"--enable-prefix-caching", "--no-enable-prefix-caching", "--max-slots", "--device"} <= engine
    for command in COMMANDS:
        sub = _subparser(parser, command.split())
        options = {option for action in sub._actions for option in action.option_strings}
        assert engine <= options, f"{command} lacks {sorted(engine - options)}"


def test_prefix_caching_is_one_flag_everywhere() -> None:
    for words in COMMANDS.values():
        args = build_parser().parse_args([*words, "--no-enable-prefix-caching"])
        assert args.enable_prefix_caching is False


def test_bad_engine_settings_say_what_is_wrong() -> None:
    args = build_parser().parse_args([*COMMANDS["serve"], "--max-slots", "0"])
    with pytest.raises(SystemExit, match=r"invalid engine settings: --max-slots: .*greater than or equal"):
        engine_config_from_args(args)


def test_the_prefill_cap_while_decoding_is_the_cpu_default_on_cpu_and_the_budget_on_cuda() -> None:
    config = EngineConfig(max_num_batched_tokens=4096)
    smollm2 = find_model("builtin:smollm2")
    assert smollm2 is not None
    layers = smollm2.linear_parameter_count()
    assert config.prefill_tokens_while_decoding("cpu", layers) == CPU_PREFILL_TOKENS_WHILE_DECODING
    assert config.prefill_tokens_while_decoding("cuda", layers) == 4096
    args = build_parser().parse_args([*COMMANDS["serve"], "--max-prefill-tokens-while-decoding", "128"])
    chosen = engine_config_from_args(args)
    for device in ("cpu", "cuda"):
        assert chosen.prefill_tokens_while_decoding(device, layers) == 128
        assert chosen.prefill_tokens_while_decoding(device, 100 * layers) == 128
    args = build_parser().parse_args([*COMMANDS["serve"], "--max-prefill-tokens-while-decoding", "0"])
    with pytest.raises(SystemExit, match=r"--max-prefill-tokens-while-decoding: .*greater than or equal"):
        engine_config_from_args(args)


def test_the_cpu_prefill_cap_while_decoding_is_smollm2s_256_tokens_of_work() -> None:
    """256 prompt tokens a step for SmolLM2-135M and anything with smaller layers; the same work (not more
    tokens) for larger layers, so a larger model's prompt chunk holds its decodes about as long; never below
    a KV block's 16 tokens."""
    shapes = {name: find_model(f"builtin:{name}") for name in ("tiny", "small", "smollm2", "llama-1b")}
    weights = {name: shape.linear_parameter_count() for name, shape in shapes.items() if shape is not None}
    assert CPU_PREFILL_TOKENS_WHILE_DECODING * weights["smollm2"] == CPU_PREFILL_WORK_WHILE_DECODING
    caps = {name: cpu_prefill_tokens_while_decoding(count) for name, count in weights.items()}
    assert caps == {"tiny": 256, "small": 256, "smollm2": 256, "llama-1b": 27}
    assert cpu_prefill_tokens_while_decoding(weights["smollm2"] + 1) == 255
    # A 7B model's layers (~6.5 G weights) would get 4 tokens by work alone.
    assert cpu_prefill_tokens_while_decoding(6_500_000_000) == CPU_MIN_PREFILL_TOKENS_WHILE_DECODING == 16
