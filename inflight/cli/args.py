"""Flags and argparse types that several commands share (the engine's own flags: engine/cli_args.py)."""

from __future__ import annotations

import argparse

LOG_LEVELS = ("debug", "info", "warning", "error")


def port_number(text: str) -> int:
    """argparse type of --port: an integer in 1..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1..65535)")
    return port


def positive(kind: type[int] | type[float]) -> argparse._ActionType:
    """argparse type: a number > 0 of `kind`."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def add_model_arg(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """`--model`, resolved by inflight.checkpoints.resolve; required unless `default` is given."""
    parser.add_argument(
        "--model",
        required=default is None,
        default=default,
        help="checkpoint folder, .gguf file, or builtin:smollm2 (a real 135M chat model) / builtin:tiny / "
        "builtin:small / builtin:llama-1b (random weights); built-in models are made once into "
        "$INFLIGHT_CACHE_DIR" + (f" (default: {default})" if default else ""),
    )


def add_listen_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """`--host` and `--port` of a command that listens."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument(
        "--port", type=port_number, default=default_port, help=f"port, 1..65535 (default: {default_port})"
    )


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: info)")
