"""`inflight crd`: the ModelServer CRD (or its field reference), rendered from the API types."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    crd = commands.add_parser("crd", help="print the ModelServer CRD (rendered from the spec models)")
    crd.add_argument("--out", type=Path, default=None, help="write to this file instead of stdout")
    crd.add_argument(
        "--check", type=Path, default=None, help="exit 1 when this file differs from the rendered CRD"
    )
    crd.add_argument(
        "--reference", action="store_true", help="print the field reference (Markdown) instead of the YAML"
    )
    crd.set_defaults(func=_run_crd)


def _run_crd(args: argparse.Namespace) -> int:
    from inflight.operator.api.crd import render_crd_yaml, render_reference_markdown

    text = render_reference_markdown() if args.reference else render_crd_yaml()
    if args.check is not None:
        current = args.check.read_text() if args.check.exists() else ""
        if current != text:
            print(
                f"{args.check} is stale: regenerate it with `inflight crd --out {args.check}`",
                file=sys.stderr,
            )
            return 1
        print(f"{args.check} is current")
        return 0
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
