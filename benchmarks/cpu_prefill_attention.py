"""The CPU prefill-attention kernel (`paged_prefill`) on long-prompt chunks: one layer's call for each
case, the K/V in 16-token blocks at shuffled addresses on huge pages, as the engine's (the prompt's own
K/V was just written, so it is in cache as in the engine).

Builds kernels.c as it is in the working tree, and optionally another kernels.c (e.g. from
`git show HEAD~1:inflight/engine/cpu/kernels.c > /tmp/old.c`), and times both on the same inputs, with
torch's SDPA (torch_paged.prefill: a causal mask offset by the prefix; torch's CPU flash attention, on the
AMX tiles where the CPU has them), alternating call by call, so machine load hits all alike. Default shape:
SmolLM2-135M's attention (9 query / 3 KV heads, head_dim 64). Reports each case's median call and its
GFLOP/s (causal: q.k and p.v over the keys each row attends).

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_prefill_attention.py [--compare /tmp/old.c]
        [--dtype bfloat16|float32] [--threads 2] [--calls 7]
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
from inflight.engine.attention import torch_paged
from inflight.engine.cpu import kernels as cpu_kernels

# (query_len, seq_len) of one prompt chunk: whole prompts, and chunks after a cached prefix.
CASES = (
    (64, 64), (128, 128), (256, 256), (512, 512), (1024, 1024), (2048, 2048), (2048, 4096), (1024, 4096),
    (4096, 4096), (64, 4096), (128, 4096),
)  # fmt: skip


def main() -> None:
    parser = parser_with_shape(__doc__)
    parser.add_argument("--calls", type=int, default=7)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    longest = max(seq_len for _, seq_len in CASES)
    blocks = -(-longest // args.block_size)
    order = list(range(blocks))
    random.Random(0).shuffle(order)
    table = torch.tensor([order], dtype=torch.int32)
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = on_huge_pages(torch.randn(shape).to(dtype))
    v_cache = on_huge_pages(torch.randn(shape).to(dtype))
    query = torch.randn(longest, args.heads, args.head_dim).to(dtype)
    out = torch.empty_like(query)

    def call(library: ctypes.CDLL, query_len: int, seq_len: int) -> float:
        prompts = torch.tensor([[0, 0, query_len, seq_len]], dtype=torch.int64)
        start = time.perf_counter()
        failed = library.paged_prefill(
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
            table.stride(0), prompts.data_ptr(), 1, args.heads, args.kv_heads, args.head_dim,
            args.block_size, 0, args.head_dim**-0.5, cpu_kernels.DTYPE_CODES[dtype],
            cpu_kernels.KV_DTYPE_CODES[dtype], out.data_ptr(), seq_len, args.threads,
        )  # fmt: skip
        assert failed == 0
        return time.perf_counter() - start

    def sdpa(query_len: int, seq_len: int) -> float:
        start = time.perf_counter()
        torch_paged.prefill(query[:query_len], k_cache, v_cache, table[0], seq_len, None, args.head_dim**-0.5)
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        systems = {"working tree": build(cpu_kernels.SOURCE, Path(tmp))}
        if args.compare is not None:
            systems[str(args.compare)] = build(args.compare, Path(tmp))
        print(
            f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, {args.dtype}, {args.threads} threads, "
            f"median of {args.calls} calls"
        )
        for query_len, seq_len in CASES:
            times: dict[str, list[float]] = {name: [] for name in systems}
            times["SDPA with a mask"] = []
            for library in systems.values():
                call(library, query_len, seq_len)  # first touch
            sdpa(query_len, seq_len)
            for _ in range(args.calls):
                for name, library in systems.items():
                    times[name].append(call(library, query_len, seq_len))
                times["SDPA with a mask"].append(sdpa(query_len, seq_len))
            ctx = seq_len - query_len
            pairs = sum(ctx + r + 1 for r in range(query_len))
            flops = 4 * pairs * args.heads * args.head_dim
            row = [f"{query_len} rows after {ctx} keys:"]
            for name, seconds in times.items():
                median = statistics.median(seconds)
                row.append(f"{name} {median * 1e3:.2f} ms ({flops / median / 1e9:.0f} GFLOP/s)")
            print("  " + "  ".join(row))


if __name__ == "__main__":
    main()
