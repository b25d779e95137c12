"""The CPU decode-attention kernel as a decode step calls it: every layer's cache in turn, so its K/V come
from memory, not from cache (a real model's caches together are far larger than L3).

Builds kernels.c as it is in the working tree, and optionally another kernels.c (e.g. from
`git show HEAD~1:inflight/engine/cpu/kernels.c > /tmp/old.c`), and times both on the same caches,
alternating, so machine load hits both alike. Default shape: SmolLM2-135M's attention (30 layers,
9 query / 3 KV heads, head_dim 64), 16-token blocks at shuffled addresses on huge pages (as the
engine's pool), contexts uniform in 0.3-1.7x --context. Reports the median step time and the K/V bytes
read per second. With `--kv-cache-dtype both` the working tree's kernels also run on float8 (e4m3)
copies of the same caches, alternating with the --dtype caches (an older kernels.c to --compare must
take the same arguments).

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_decode_attention.py [--compare /tmp/old.c]
        [--dtype bfloat16|float32] [--kv-cache-dtype auto|fp8|both] [--seqs 64] [--context 250]
        [--threads 2] [--steps 8]
"""

from __future__ import annotations

import ctypes
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cpu_attention_common import build, on_huge_pages, parser_with_shape
from inflight.engine.attention.kv_store import FP8_DTYPE, to_cache
from inflight.engine.cpu import kernels as cpu_kernels


def main() -> None:
    parser = parser_with_shape(__doc__)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "both"], default="auto")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=250)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    lens = [max(1, int(rng.uniform(0.3, 1.7) * args.context)) for _ in range(args.seqs)]
    blocks_of = [-(-n // args.block_size) for n in lens]
    order = list(range(sum(blocks_of)))
    rng.shuffle(order)
    tables = torch.zeros(args.seqs, max(blocks_of), dtype=torch.int32)
    taken = 0
    for i, count in enumerate(blocks_of):
        tables[i, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
        taken += count
    shape = (len(order), args.block_size, args.kv_heads, args.head_dim)
    caches = [
        (on_huge_pages(torch.randn(shape).to(dtype)), on_huge_pages(torch.randn(shape).to(dtype)))
        for _ in range(args.layers)
    ]
    cache_sets = {"auto": caches}
    if args.kv_cache_dtype != "auto":
        cache_sets["fp8"] = [
            (on_huge_pages(to_cache(k, FP8_DTYPE)), on_huge_pages(to_cache(v, FP8_DTYPE))) for k, v in caches
        ]
    if args.kv_cache_dtype == "fp8":
        del cache_sets["auto"]
    query = torch.randn(args.seqs, args.heads, args.head_dim).to(dtype)
    out = torch.empty_like(query)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    rows = torch.arange(args.seqs, dtype=torch.int64)

    def step(library: ctypes.CDLL, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        kv_code = cpu_kernels.KV_DTYPE_CODES[caches[0][0].dtype]
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            failed = library.paged_decode(
                query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), rows.data_ptr(), rows.data_ptr(),
                args.seqs, args.heads, args.kv_heads, args.head_dim, args.block_size, 0,
                args.head_dim**-0.5, cpu_kernels.DTYPE_CODES[dtype], kv_code, out.data_ptr(), max(lens),
                args.threads,
            )  # fmt: skip
            assert failed == 0
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        working_tree = build(cpu_kernels.SOURCE, Path(tmp))
        systems = {
            f"working tree, {kind} KV": (working_tree, cache_set) for kind, cache_set in cache_sets.items()
        }
        if args.compare is not None:
            systems[str(args.compare)] = (build(args.compare, Path(tmp)), caches)
        times: dict[str, list[float]] = {name: [] for name in systems}
        for library, cache_set in systems.values():
            step(library, cache_set)  # first touch
        for _ in range(args.steps):
            for name, (library, cache_set) in systems.items():
                times[name].append(step(library, cache_set))
    elements = args.layers * 2 * sum(lens) * args.kv_heads * args.head_dim
    print(
        f"{args.layers} layers, {args.seqs} sequences of {min(lens)}-{max(lens)} tokens, {args.heads}/"
        f"{args.kv_heads} heads x {args.head_dim}, {args.dtype} queries, {args.threads} threads: "
        f"{elements * query.element_size() / 1e6:.0f} MB of {args.dtype} K/V per step"
    )
    for name, seconds in times.items():
        median = statistics.median(seconds)
        kv_bytes = elements * systems[name][1][0][0].element_size()
        print(f"  {name}: median step {median * 1e3:.2f} ms, {kv_bytes / median / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
