"""What the CPU attention benchmarks share: building a kernels.c into the engine's library, caches on
huge pages as the engine's are, and the attention shape's command-line arguments (SmolLM2-135M's by
default)."""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import torch

from inflight.engine.cpu import huge_pages
from inflight.engine.cpu import kernels as cpu_kernels


def build(source: Path, out_dir: Path) -> ctypes.CDLL:
    """The engine's library with kernels.c from `source`, built with the engine's flags into `out_dir`."""
    return cpu_kernels.load_library(cpu_kernels.build_library(out_dir=out_dir, kernels_source=source))


def on_huge_pages(cache: torch.Tensor) -> torch.Tensor:
    """A copy of `cache` on huge pages where Linux gives them, as the engine's KV pool is (runner.py).
    On 4 KiB pages a float32 decode step over long contexts read its K/V 1.2x slower on Sapphire Rapids
    (15.8 against 19.4 GB/s, 5 December): the page walks, not the kernel."""
    copy = huge_pages.zeros(tuple(cache.shape), cache.dtype, "benchmark KV cache")
    copy.copy_(cache)
    return copy


def parser_with_shape(description: str | None) -> argparse.ArgumentParser:
    """A parser with --compare, --dtype, the attention shape (heads, KV heads, head size, block size)
    and --threads."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", type=Path, help="another kernels.c to time against the working tree's")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    return parser
