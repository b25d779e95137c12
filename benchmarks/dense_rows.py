"""`dense_linear` (cpu/kernels.c) against oneDNN's prepacked product (what PrepackedLinear runs above
dense_linear's rows) on llama-1b's decode shapes: random weights, 2 threads, enough copies of each
matrix to stream ~400 MB from memory per pass, the two alternating for 3 timed passes (after a warm-up);
prints the median ms per product and the weight bytes streamed per second, and checks that each row's
C result equals that row multiplied alone. With a third argument, another kernels.c (e.g. from
`git show REV:inflight/engine/cpu/kernels.c > /tmp/old.c`) is built and timed alongside, in turn.

    flock /tmp/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/dense_rows.py bfloat16|float32 5,8 \
        [/tmp/old.c]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.cpu_attention_common import build
from inflight.engine.cpu.linear import PrepackedLinear, dense_linear

# llama-1b (out x in): the fused q/k/v, o, the fused gate/up, down, the LM head.
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]
PASS_BYTES = 400e6
PASSES = 3


def onednn(x: torch.Tensor, module: PrepackedLinear) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, None, "none", [], "")


def in_c(x: torch.Tensor, module: PrepackedLinear) -> torch.Tensor:
    return dense_linear(x, module.weight, None)


Product = Callable[[torch.Tensor, PrepackedLinear], torch.Tensor]
KINDS: dict[str, Product] = {"oneDNN": onednn, "C": in_c}


def seconds_per_product(x: torch.Tensor, modules: list[PrepackedLinear], product: Product) -> float:
    """One pass over the copies: seconds per product."""
    start = time.perf_counter()
    for module in modules:
        product(x, module)
    return (time.perf_counter() - start) / len(modules)


def main() -> None:
    dtype = getattr(torch, sys.argv[1])
    row_counts = [int(rows) for rows in sys.argv[2].split(",")]
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        if len(sys.argv) > 3:
            other = build(Path(sys.argv[3]), Path(tmp))

            def in_other(x: torch.Tensor, module: PrepackedLinear) -> torch.Tensor:
                return dense_linear(x, module.weight, None, other)

            KINDS[f"C {Path(sys.argv[3]).name}"] = in_other
        measure(dtype, row_counts)


def measure(dtype: torch.dtype, row_counts: list[int]) -> None:
    for n, k in SHAPES:
        weight_bytes = n * k * dtype.itemsize
        copies = max(2, int(PASS_BYTES // weight_bytes))
        modules = [PrepackedLinear(nn.Linear(k, n, bias=False).to(dtype), 64) for _ in range(copies)]
        line = f"{dtype} {n}x{k} ({weight_bytes / 1e6:.0f} MB)"
        with torch.inference_mode():
            for rows in row_counts:
                x = torch.randn(rows, k).to(dtype)
                times: dict[str, list[float]] = {kind: [] for kind in KINDS}
                for pass_ in range(PASSES + 1):  # pass 0: warm-up, not counted
                    for kind, product in KINDS.items():
                        seconds = seconds_per_product(x, modules, product)
                        if pass_ > 0:
                            times[kind].append(seconds)
                together = dense_linear(x, modules[0].weight, None)
                alone = all(
                    torch.equal(together[r : r + 1], dense_linear(x[r : r + 1], modules[0].weight, None))
                    for r in range(rows)
                )
                medians = {kind: statistics.median(values) for kind, values in times.items()}
                line += f" | {rows} rows " + " / ".join(
                    f"{kind} {m * 1e3:.2f} ms ({weight_bytes / m / 1e9:.1f} GB/s)"
                    for kind, m in medians.items()
                )
                line += "" if alone else " ROW-DEPENDENT"
        print(line, flush=True)
        del modules


if __name__ == "__main__":
    main()
