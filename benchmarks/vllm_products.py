"""The engine's oneDNN product (torch's prepacked linear, what the engine multiplies above its C kernels'
row limit) against vLLM-CPU's own (`create_onednn_mm` / `onednn_mm`, what vLLM uses for dense layers on
a CPU without AMX), at the same shapes and row counts, with the weights streaming from memory as in a
decode step: each shape's weight is copied to ~400 MB and every pass runs over all copies, the two
products alternating pass by pass; prints each one's median pass (ms a product, GFLOP/s) and the ratio.
Runs in vLLM's environment (`make bench-vllm`), which has torch too:

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_products.py --dtype bfloat16 --shapes llama-1b \
        [--rows 1,8,12,16,24] [--threads 2] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.prepack_hint import SHAPES
from inflight.engine.config import EngineConfig

WEIGHT_BYTES = 400_000_000  # more than any L3 of the machines measured: the weights come from memory
# The batch-size hint the engine reorders its weights for: its slot count (prepare_linears), by default.
PACKING_HINT: int = EngineConfig.model_fields["max_num_seqs"].default


def pass_seconds(product: Callable[[int], object], copies: int) -> float:
    """Seconds a product takes, averaged over one pass through every weight copy."""
    start = time.perf_counter()
    for i in range(copies):
        product(i)
    return (time.perf_counter() - start) / copies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shapes", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,8,12,16,24")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    from vllm import _custom_ops as ops  # vLLM's environment only

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    for n, k in SHAPES[args.shapes]:
        copies = max(2, WEIGHT_BYTES // (n * k * dtype.itemsize))
        weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=PACKING_HINT) for w in weights]
        handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        for rows in rows_list:
            x = torch.randn(rows, k).to(dtype)

            def engine(i: int, x: torch.Tensor = x, packed: list[torch.Tensor] = packed) -> object:
                return torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")

            def vllm(i: int, x: torch.Tensor = x, handlers: list[object] = handlers) -> object:
                return ops.onednn_mm(handlers[i], x, None)

            pass_seconds(engine, copies)
            pass_seconds(vllm, copies)
            times: dict[str, list[float]] = {"engine": [], "vllm": []}
            for _ in range(args.passes):
                times["engine"].append(pass_seconds(engine, copies))
                times["vllm"].append(pass_seconds(vllm, copies))
            ours, theirs = statistics.median(times["engine"]), statistics.median(times["vllm"])
            gflop = 2 * rows * n * k / 1e9
            print(
                f"{n:>6} x {k:<5} {rows:>3} rows: engine {ours * 1e3:7.3f} ms ({gflop / ours:6.1f} GFLOP/s), "
                f"vLLM {theirs * 1e3:7.3f} ms ({gflop / theirs:6.1f} GFLOP/s), vLLM's speed / the engine's "
                f"{ours / theirs:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
