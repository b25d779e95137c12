"""oneDNN's prepacked linear by the batch-size hint the weight was reordered for, at the row counts the
engine multiplies (decode steps and prompt chunks), against MKL's packed sgemm for float32.

    PYTHONPATH=. .venv/bin/python benchmarks/prepack_hint.py --dtype float32 --shapes smollm2 \
        [--hints 1,16,64,2048] [--rows 16,64,512,2048] [--threads 2]

Each product runs with the weights of every hint in turn, call after call (median of --calls), and
prints GFLOP/s per (shape, rows, hint)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = {
    # (out, in): the projections of one layer, fused as the engine holds them, and the LM head.
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "llama-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)],
}


def seconds(calls: int, fn: Callable[..., object], *args: object) -> float:
    fn(*args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shapes", default="smollm2")
    parser.add_argument("--hints", default="1,16,64,2048")
    parser.add_argument("--rows", default="16,64,512,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--mkl", action="store_true", help="also MKL's packed sgemm (float32)")
    parser.add_argument("--max-rows-head", type=int, default=64, help="LM head only up to these rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    pointwise = torch.ops.mkldnn._linear_pointwise
    hints = [int(h) for h in args.hints.split(",")]
    torch.manual_seed(0)
    with torch.inference_mode():
        for out_f, in_f in SHAPES[args.shapes]:
            weight = torch.randn(out_f, in_f, dtype=dtype) * 0.02
            packed = {h: torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=h) for h in hints}
            for rows in (int(r) for r in args.rows.split(",")):
                if out_f > 100_000 and rows > args.max_rows_head:
                    continue
                x = torch.randn(rows, in_f, dtype=dtype)
                flop = 2 * rows * out_f * in_f
                cells = []
                for h in hints:
                    t = seconds(args.calls, pointwise, x, packed[h], None, "none", [], "")
                    cells.append(f"hint {h}: {flop / t / 1e9:6.1f}")
                if args.mkl and dtype == torch.float32:
                    mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                    t = seconds(args.calls, torch.ops.mkl._mkl_linear, x, mkl, weight, None, rows)
                    cells.append(f"mkl: {flop / t / 1e9:6.1f}")
                    t = seconds(args.calls, torch.nn.functional.linear, x, weight)
                    cells.append(f"F.linear: {flop / t / 1e9:6.1f}")
                print(f"{out_f:6d}x{in_f:<5d} rows {rows:5d}  " + "  ".join(cells) + "  GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
