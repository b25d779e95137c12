"""Subcommands of this area, registered into the `inflight` CLI. Keep imports inside handlers lazy."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to `commands` and its benchmarks to `bench`."""
