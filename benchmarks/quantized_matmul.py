"""Weight-quantized matmuls on CPU at SmolLM2-135M's shapes: inflight's quant_kernels.c (Q4 `u4` and Q8
`s8` layouts) against oneDNN's prepacked float product (what the engine runs for float weights) and,
where it is importable, torchao's int8 weight-only CPU path (torchao is not a dependency: put it on
PYTHONPATH, e.g. `pip download --no-deps torchao` and unzip the wheel; 0.18.0's int4 weight-only has no
CPU packing format outside its prototype package).

Per row count (decode batch 1, 16, 64; a 256-token prefill chunk) it times one decoder layer's four
projections (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536) and the LM head
(49152 x 576), each system in turn, repeated (A, B, C, A, B, C, ...) so machine load hits all alike, and
prints the best (least disturbed by other jobs on a shared machine) microseconds per call. The fused
kernel is timed alone (inflight's engine switches to dequantize + GEMM above KERNEL_MAX_ROWS rows:
"inflight ... engine" columns).

    PYTHONPATH=. .venv/bin/python benchmarks/quantized_matmul.py [--dtype bfloat16] [--threads 1]
        [--rows 1 16 64 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from torch import nn

from inflight.engine.cpu import quantized as quantized_module
from inflight.engine.cpu.linear import PrepackedLinear, can_prepack
from inflight.engine.cpu.quantized import QuantizedTensor, quantized_linear
from inflight.engine.gguf.repack import quantize

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = [(49152, 576)]


def _torchao_systems(weights: list[torch.Tensor], dtype: torch.dtype) -> dict[str, list[nn.Module]]:
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return {}
    systems: dict[str, list[nn.Module]] = {}
    configs = {
        "torchao int8": lambda: Int8WeightOnlyConfig(),
    }
    for name, make in configs.items():
        modules: list[nn.Module] = []
        try:
            for w in weights:
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
                linear.weight.data.copy_(w)
                quantize_(linear, make())
                modules.append(linear)
        except Exception as e:  # a config this torch/torchao pair cannot run: report it, go on
            print(f"{name}: unavailable ({type(e).__name__}: {str(e)[:120]})")
            continue
        systems[name] = modules
    return systems


def _quantized(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    return quantized_linear(x, weight)


def _fused(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    limit = quantized_module.KERNEL_MAX_ROWS
    quantized_module.KERNEL_MAX_ROWS = x.shape[0]
    try:
        return quantized_linear(x, weight)
    finally:
        quantized_module.KERNEL_MAX_ROWS = limit


def _run_all(fns: list[Callable[[torch.Tensor], torch.Tensor]], xs: list[torch.Tensor]) -> None:
    for fn, x in zip(fns, xs, strict=True):
        fn(x)


def _time(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    for label, shapes in (("decoder layer (4 projections)", LAYER), ("LM head", LM_HEAD)):
        weights = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for n, k in shapes]
        systems: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
        if can_prepack(torch.device("cpu"), dtype):
            packed = []
            for w in weights:
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
                linear.weight.data.copy_(w)
                packed.append(PrepackedLinear(linear, 64))
            systems[f"oneDNN {args.dtype}"] = [m.forward for m in packed]
        for fmt in ("q4_1", "q8_0"):
            quantized = [quantize(w.float(), fmt) for w in weights]
            systems[f"inflight {fmt} fused"] = [functools.partial(_fused, weight=q) for q in quantized]
        systems["inflight q4_1 engine"] = [functools.partial(_quantized, weight=q) for q in quantized]
        for name, modules in _torchao_systems(weights, dtype).items():
            systems[name] = [m.forward for m in modules]
        print(f"\n{label}, {args.dtype}, {args.threads} threads: best us per call")
        print(f"{'rows':>6} " + " ".join(f"{name:>18}" for name in systems))
        with torch.inference_mode():
            for rows in args.rows:
                xs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes]
                calls = max(1, min(50, 2000 // rows))
                for fns in systems.values():  # warm-up: primitives built, buffers faulted in
                    for fn, x in zip(fns, xs, strict=True):
                        fn(x)
                times: dict[str, list[float]] = {name: [] for name in systems}
                for _ in range(args.repeats):
                    for name, fns in systems.items():
                        times[name].append(_time(functools.partial(_run_all, fns, xs), calls))
                print(f"{rows:>6} " + " ".join(f"{min(t):>18.0f}" for t in times.values()))


if __name__ == "__main__":
    main()
