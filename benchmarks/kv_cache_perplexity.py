"""Perplexity of a model over a fixed text with each KV cache dtype (#30 item 2: FP8 KV within 1 % of the
bfloat16 KV cache). The text is fixed: the repository's docs/*.md (in name order) and README.md as of
commit TEXT_COMMIT (read with `git show`), tokenized and cut to --tokens. It is scored as windows of
--window tokens, each window one request whose prompt log-probabilities (prompt_logprobs=0) give every
token's NLL after the window's first. The K/V of each window pass through the KV cache (written, then
read by the paged attention of the later tokens), so the cache's element type is what differs between
the runs.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_cache_perplexity.py [--model builtin:smollm2]
        [--dtype bfloat16] [--tokens 4096] [--window 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

from inflight import LLM, SamplingParams
from inflight.checkpoints.resolve import resolve_model

ROOT = Path(__file__).resolve().parents[1]
TEXT_COMMIT = "3dc37140873cc2273ae9e16a3b70820d5e9e5919"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def fixed_text() -> str:
    names = git("ls-tree", "--name-only", f"{TEXT_COMMIT}:docs").split()
    paths = [f"docs/{name}" for name in sorted(names) if name.endswith(".md")] + ["README.md"]
    return "\n\n".join(git("show", f"{TEXT_COMMIT}:{path}") for path in paths)


def mean_nll(llm: LLM, windows: list[list[int]], first_scored: int = 1) -> float:
    """Mean negative log-likelihood of each window's tokens from index `first_scored` on."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    total, count = 0.0, 0
    for output, window in zip(llm.generate(windows, params), windows, strict=True):
        assert output.prompt_logprobs is not None
        scored = zip(output.prompt_logprobs[first_scored:], window[first_scored:], strict=True)
        for entry, token in scored:
            assert entry is not None
            total -= entry[token].logprob
            count += 1
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    model = str(resolve_model(args.model))
    results = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(model, device="cpu", dtype=args.dtype, kv_cache_dtype=kv_cache_dtype, max_slots=4)
        ids = llm.tokenizer.encode(fixed_text())[: args.tokens]
        windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
        nll = mean_nll(llm, windows)
        llm.close()
        results[kv_cache_dtype] = {"mean_nll": round(nll, 5), "perplexity": round(math.exp(nll), 4)}
    ratio = results["fp8"]["perplexity"] / results["auto"]["perplexity"]
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "tokens": len(ids),
                **results,
                "fp8_over_auto": round(ratio, 5),
            }
        )
    )


if __name__ == "__main__":
    main()
