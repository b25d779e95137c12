"""GPU benchmark of FP8 (e4m3) weights against bfloat16 (one prepared run, a few minutes on an H200).

    .venv/bin/python benchmarks/fp8_gpu.py --out bench-results/fp8

1. Correctness on the GPU: each FP8 path (torch._scaled_mm with per-token activation scales; the Triton
   kernel for GPUs without FP8 tensor cores) against the dequantized bfloat16 product (relative error).
2. Linear throughput of the decoder projections of Llama-3.1-8B and Llama-3.1-70B (q/k/v fused, o,
   gate/up fused, down; unsplit) at decode (M = 1, 8, 16, 32, 64 tokens) and prefill (M = 2048) shapes:
   bfloat16 F.linear vs engine/fp8/linear.py (activation quantization included), median of CUDA-event
   timings, as TFLOP/s and the FP8 / bfloat16 speedup.
3. End to end: `inflight.LLM` on builtin:llama-1b (bfloat16), generated tokens/s for a fixed greedy
   workload with --quantization none, fp8, and fp8 with --kv-cache-dtype fp8, alternating (two rounds).

Writes fp8_gpu.json (all figures) and prints a summary. Exits at once, with a message, without CUDA. Each
part records its error in the JSON and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from inflight.engine.fp8.linear import (
    fp8_linear,
    quantize_activations,
    quantize_activations_torch,
    scaled_mm_linear,
    triton_linear,
    uses_scaled_mm,
)
from inflight.engine.fp8.weights import quantize_fp8

# (in_features, out_features) of each decoder projection, q/k/v and gate/up fused as the engine has them.
LAYERS: dict[str, dict[str, tuple[int, int]]] = {
    "llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
    "llama-3.1-70b": {
        "qkv": (8192, 10240),
        "o": (8192, 8192),
        "gate_up": (8192, 57344),
        "down": (28672, 8192),
    },
}
TOKENS = (1, 8, 16, 32, 64, 2048)


def cuda_time_ms(fn: Callable[[], object], iterations: int) -> float:
    """Median milliseconds of `fn` over `iterations` calls, each timed with CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def correctness() -> dict[str, float | bool]:
    """Relative error of each product path against the dequantized float32 product (64 and 1 rows), and
    whether the activation-quantization kernel gives PyTorch's values bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(4096, 4096, device="cuda", generator=gen)
    fp8 = quantize_fp8(weight)
    x = torch.randn(64, 4096, device="cuda", generator=gen).bfloat16()
    reference = F.linear(x.float(), fp8.dequantize())
    results: dict[str, float | bool] = {}
    paths = {
        "triton": lambda: triton_linear(x, fp8.values, fp8.scale),
        "triton_1_row": lambda: triton_linear(x[:1], fp8.values, fp8.scale),
    }
    if uses_scaled_mm(x, fp8.values):
        paths["scaled_mm"] = lambda: scaled_mm_linear(x, fp8.values, fp8.scale)
    for name, run in paths.items():
        out = run().float()
        expected = reference[: out.shape[0]]
        results[name] = ((out - expected).norm() / expected.norm()).item()
    values, scales = quantize_activations(x * 100)
    torch_values, torch_scales = quantize_activations_torch(x * 100)
    results["quantize_kernel_equals_torch"] = torch.equal(scales, torch_scales) and torch.equal(
        values.view(torch.uint8), torch_values.view(torch.uint8)
    )
    return results


def time_layer(model: str, layer: str, k: int, n: int) -> list[dict[str, Any]]:
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    fp8 = quantize_fp8(weight)
    rows = []
    for m in TOKENS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        iterations = 20 if m == 2048 else 50

        def bf16(x: torch.Tensor = x) -> torch.Tensor:
            return F.linear(x, weight)

        def fp8_product(x: torch.Tensor = x) -> torch.Tensor:
            return fp8_linear(x, fp8.values, fp8.scale)

        bf16_ms = cuda_time_ms(bf16, iterations)
        fp8_ms = cuda_time_ms(fp8_product, iterations)
        flops = 2 * m * n * k
        rows.append(
            {
                "model": model,
                "layer": layer,
                "M": m,
                "K": k,
                "N": n,
                "bf16_ms": bf16_ms,
                "fp8_ms": fp8_ms,
                "bf16_tflops": flops / bf16_ms / 1e9,
                "fp8_tflops": flops / fp8_ms / 1e9,
                "speedup": bf16_ms / fp8_ms,
            }
        )
    return rows


def linear_throughput() -> list[dict[str, Any]]:
    return [
        row
        for model, layers in LAYERS.items()
        for layer, (k, n) in layers.items()
        for row in time_layer(model, layer, k, n)
    ]


def end_to_end(prompts: int, max_tokens: int) -> dict[str, list[float]]:
    from inflight.checkpoints.resolve import resolve_model
    from inflight.engine.llm import LLM
    from inflight.engine.sequence import SamplingParams

    folder = resolve_model("builtin:llama-1b")
    gen = torch.Generator().manual_seed(0)
    token_prompts = [torch.randint(100, 30000, (256,), generator=gen).tolist() for _ in range(prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # (weights, KV cache) per run: bfloat16 weights, FP8 weights, FP8 weights and an FP8 KV cache.
    settings = {"none": ("none", "auto"), "fp8": ("fp8", "auto"), "fp8+fp8_kv": ("fp8", "fp8")}
    results: dict[str, list[float]] = {name: [] for name in settings}
    # One engine at a time (each sizes its KV cache to the free GPU memory), alternating.
    for _ in range(2):
        for name, (quantization, kv_cache_dtype) in settings.items():
            llm = LLM(
                str(folder),
                device="cuda",
                dtype="bfloat16",
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
            )
            try:
                llm.generate(token_prompts[:8], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
                start = time.perf_counter()
                outputs = llm.generate(token_prompts, params)
                elapsed = time.perf_counter() - start
            finally:
                llm.close()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
            results[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
            print(f"end to end {name}: {results[name][-1]:.0f} tokens/s", file=sys.stderr, flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/fp8"))
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "fp8_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False here). "
            "Run it on a machine with one; the CPU FP8 path is covered by tests/engine/fp8.",
            file=sys.stderr,
        )
        return 2
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "capability": torch.cuda.get_device_capability(),
    }
    parts: dict[str, Callable[[], Any]] = {
        "correctness": correctness,
        "linear": linear_throughput,
        "end_to_end_tokens_per_s": lambda: end_to_end(args.prompts, args.max_tokens),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        started = time.perf_counter()
        try:
            results[name] = part()
        except Exception:  # recorded; the other parts still run
            results[name] = {"error": traceback.format_exc()}
        print(f"{name}: {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
        # Rewritten after each part: a run cut short keeps what it measured.
        (args.out / "fp8_gpu.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results.get("correctness"), indent=2))
    linear = results.get("linear")
    if isinstance(linear, list):
        for row in linear:
            print(
                f"{row['model']:14} {row['layer']:8} M={row['M']:5}  bf16 {row['bf16_tflops']:7.1f}  "
                f"fp8 {row['fp8_tflops']:7.1f} TFLOP/s  x{row['speedup']:.2f}"
            )
    print(json.dumps(results.get("end_to_end_tokens_per_s"), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
