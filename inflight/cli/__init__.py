"""`inflight` command line: the top layer. One module per command; each `register`s its parser and keeps
heavy imports (torch, FastAPI, kopf) inside its handler, so `inflight --help` and the operator image
(no torch) stay light. Library packages never import from here.
"""

from __future__ import annotations

import argparse
import os
import sys

from inflight import __version__
from inflight.cli import bench, crd, demo, download, generate, make_model, operator, router, serve, size
from inflight.engine.cpu import openmp

COMMANDS = (bench, generate, make_model, serve, demo, operator, crd, size, download, router)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inflight",
        description="Continuous batching over a paged KV cache, an OpenAI-compatible server, "
        "and a Kubernetes operator that sizes it.",
    )
    parser.add_argument("--version", action="version", version=f"inflight {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    openmp.configure(os.environ)
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
