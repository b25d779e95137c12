"""The engine's flags are one set: the same options in serve, generate, demo and bench serve, and their
defaults are EngineConfig's."""

from __future__ import annotations

import argparse

import pytest

from inflight.cli import build_parser
from inflight.engine.cli_args import add_engine_args, engine_config_from_args
from inflight.engine.config import CPU_PREFILL_TOKENS_WHILE_DECODING, EngineConfig

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
    assert config.prefill_tokens_while_decoding("cpu") == CPU_PREFILL_TOKENS_WHILE_DECODING
    assert config.prefill_tokens_while_decoding("cuda") == 4096
    args = build_parser().parse_args([*COMMANDS["serve"], "--max-prefill-tokens-while-decoding", "128"])
    chosen = engine_config_from_args(args)
    assert chosen.prefill_tokens_while_decoding("cpu") == chosen.prefill_tokens_while_decoding("cuda") == 128
    args = build_parser().parse_args([*COMMANDS["serve"], "--max-prefill-tokens-while-decoding", "0"])
    with pytest.raises(SystemExit, match=r"--max-prefill-tokens-while-decoding: .*greater than or equal"):
        engine_config_from_args(args)
