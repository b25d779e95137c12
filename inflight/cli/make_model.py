"""`inflight make-model`: a random-weight checkpoint (checkpoints/make.py); torch loads in the handler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inflight.checkpoints.builtin import RANDOM_PRESETS


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "make-model",
        help="write a random-weight Hugging Face checkpoint (Llama/Qwen2/Mistral) with a trained tokenizer",
        description="Write a Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer files "
        "with a chat template) with random weights and a byte-level BPE tokenizer trained on the Python "
        "standard library's sources. The same arguments give the same bytes.",
    )
    parser.add_argument(
        "--preset",
        choices=RANDOM_PRESETS,
        default="tiny",
        help="model size (default: tiny; llama-1b: Llama-3.2-1B's shape, 2.5 GB)",
    )
    parser.add_argument(
        "--arch", choices=("llama", "qwen2", "mistral"), default="llama", help="architecture (default: llama)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--force", action="store_true", help="replace --out if it already holds files")
    parser.set_defaults(func=_make_model)


def _make_model(args: argparse.Namespace) -> int:
    from inflight.checkpoints.make import make_model

    try:
        out = make_model(args.out, preset=args.preset, arch=args.arch, seed=args.seed, overwrite=args.force)
    except FileExistsError as e:
        print(f"inflight make-model: {e}", file=sys.stderr)
        return 2
    print(f"make-model: done: {out.resolve()}", file=sys.stderr)
    return 0
