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


# How long an idle OpenMP worker spins before it sleeps, in libgomp's GOMP_SPINCOUNT units (pause
# instructions: about 50-100 us). libgomp's default spins 100x longer, which on a shared machine starves the
# threads doing real work (8x slower engine steps); sleeping at once (OMP_WAIT_POLICY=PASSIVE) makes every
# parallel region wake its workers, 20-30 % of a CPU decode step's time. Measurements: docs/benchmarks.md.
OPENMP_SPIN_COUNT = "3000"


def configure_openmp(environ: dict[str, str] | os._Environ[str]) -> None:
    """Set the OpenMP spin count before torch loads OpenMP, unless the user chose a wait policy or a spin
    count (OMP_WAIT_POLICY, GOMP_SPINCOUNT): theirs win."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT


def main(argv: list[str] | None = None) -> int:
    configure_openmp(os.environ)
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
