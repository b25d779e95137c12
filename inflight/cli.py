"""`inflight` command line. Each area registers its own subcommands; heavy imports happen in `run`."""

from __future__ import annotations

import argparse
import os
import sys

from inflight import __version__
from inflight.bench import commands as benchmark_commands
from inflight.download import commands as download_commands
from inflight.engine import commands as engine_commands
from inflight.engine.model import commands as model_commands
from inflight.operator import commands as operator_commands
from inflight.router import commands as router_commands
from inflight.server import commands as server_commands
from inflight.sim import commands as sim_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inflight",
        description="Continuous batching over a paged KV cache, an OpenAI-compatible server, "
        "and a Kubernetes operator that sizes it.",
    )
    parser.add_argument("--version", action="version", version=f"inflight {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser("bench", help="benchmarks (offline engine, served HTTP)")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for area in (
        engine_commands,
        model_commands,
        server_commands,
        sim_commands,
        operator_commands,
        download_commands,
        router_commands,
        benchmark_commands,
    ):
        area.register(commands, bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch loads OpenMP: idle worker threads sleep instead of spinning. On a busy or small
    # machine spinning workers starve the threads doing real work (docs/benchmarks.md has the
    # measurement). An explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
