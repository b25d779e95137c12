"""GPU benchmark: tensor parallelism, N = 1, 2, 4 ranks (one GPU each) on one prepared run.

    .venv/bin/python benchmarks/gpu_tensor_parallel.py --out bench-results/gpu-tp

On a random Llama-3.2-1B-shaped bf16 checkpoint (written once to a temp dir, see gpu_kernels.py), for
each N that the visible GPUs allow (N must divide 32 heads / 8 KV heads; sizes above the GPU count are
skipped with a message):
- greedy tokens of a small workload equal N=1's (the exactness check of tests/parallel on NCCL);
- generated tokens/s of a fixed workload, and the parameter bytes and KV blocks per rank.
Writes gpu_tensor_parallel.json and prints a summary. Exits at once, with a message, without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import require_cuda, say, write_random_llama_1b

DEGREES = (1, 2, 4)


def run_degree(
    folder: Path, tp: int, prompts: list[list[int]], output_len: int, max_slots: int
) -> dict[str, Any]:
    from inflight import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(folder), max_slots=max_slots, dtype="bfloat16", tensor_parallel_size=tp)
    setup = time.perf_counter() - start
    try:
        check = llm.generate(prompts[:8], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {
            "tensor_parallel_size": tp,
            "setup_seconds": setup,
            "check_tokens": [o.outputs[0].token_ids for o in check],
            "generated_tokens": generated,
            "seconds": seconds,
            "tokens_per_s": generated / seconds,
            "parameter_bytes_per_rank": llm.engine.parameter_bytes_per_rank,
            "kv_blocks": llm.engine.num_kv_blocks,
        }
    finally:
        llm.close()
        del llm
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu-tp"))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-slots", type=int, default=128)
    args = parser.parse_args()
    require_cuda()
    gpus = torch.cuda.device_count()
    results: dict[str, Any] = {"gpus": gpus, "device": torch.cuda.get_device_name(0), "runs": []}
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 128000, (args.num_requests, args.prompt_len), generator=generator).tolist()
    with tempfile.TemporaryDirectory(prefix="inflight-tp-llama1b-") as tmp:
        folder = Path(tmp)
        write_random_llama_1b(folder)
        for tp in DEGREES:
            if tp > gpus:
                say(f"tp={tp}: skipped, only {gpus} GPU(s) visible")
                continue
            try:
                row = run_degree(folder, tp, prompts, args.output_len, args.max_slots)
            except Exception as error:  # record and go on: one run says as much as it can
                results["runs"].append({"tensor_parallel_size": tp, "error": repr(error)})
                say(f"tp={tp}: failed: {error!r}")
                continue
            base = results["runs"][0] if results["runs"] and "check_tokens" in results["runs"][0] else row
            row["tokens_equal_tp1"] = row["check_tokens"] == base["check_tokens"]
            results["runs"].append(row)
            mib = ", ".join(f"{b / 2**20:.0f}" for b in row["parameter_bytes_per_rank"])
            say(
                f"tp={tp}: {row['tokens_per_s']:.0f} tokens/s, setup {row['setup_seconds']:.1f} s, "
                f"MiB per rank [{mib}], {row['kv_blocks']} KV blocks, "
                f"tokens equal N=1: {row['tokens_equal_tp1']}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_tensor_parallel.json"
    path.write_text(json.dumps(results, indent=2))
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
