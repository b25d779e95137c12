"""Perplexity of inflight against llama.cpp's `llama-perplexity` on the same GGUF files (#30: within 1 %).

The text is kv_cache_perplexity.py's fixed text (the repository's docs at a fixed commit), tokenized by
llama.cpp (`llama-tokenize`, the tokenization llama-perplexity does) and scored by both with
llama-perplexity's method: chunks of --ctx tokens (the first chunk --chunks of them), each evaluated from an
empty cache with its first token replaced by BOS when the model adds one, and only the second half scored:
the tokens at positions ctx/2+1 .. ctx-1 of each chunk (perplexity.cpp `first = n_ctx/2`). inflight scores
the same token ids through prompt log-probabilities; the table also says whether inflight's own tokenizer
gives the same ids. The files: the real SmolLM2 Q4_1 GGUF (builtin:smollm2) and a Q8_0 file made from its
weights (gguf_q8_0.py), made once into the cache. llama.cpp must be built first (`make llama-cpp`).

    PYTHONPATH=. .venv/bin/python benchmarks/llama_cpp_perplexity.py [--ctx 512] [--chunks 40]
        [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
from pathlib import Path

from gguf import GGUFReader

from benchmarks.gguf_q8_0 import write_q8_0
from benchmarks.kv_cache_perplexity import TEXT_COMMIT, fixed_text, mean_nll
from benchmarks.llama_cpp import binary, root
from inflight import LLM
from inflight.checkpoints.builtin import builtin_model_path

FINAL_ESTIMATE = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def final_perplexity(log: str) -> float:
    """The perplexity llama-perplexity reports on its last line."""
    match = FINAL_ESTIMATE.search(log)
    if match is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{log[-2000:]}")
    return float(match.group(1))


def token_ids(printed: str) -> list[int]:
    """The ids `llama-tokenize --ids` prints as one list, e.g. "[1, 2, 3]"."""
    match = re.search(r"\[([0-9, ]*)\]", printed)
    if match is None:
        raise RuntimeError(f"llama-tokenize printed no id list:\n{printed[-2000:]}")
    return [int(part) for part in match.group(1).split(",") if part.strip()]


def chunks(ids: list[int], ctx: int, count: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: `count` consecutive runs of `ctx` ids, the first of each replaced by `bos`
    (None: the model adds no BOS)."""
    if len(ids) < count * ctx:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} chunks of {ctx}")
    windows = [ids[i * ctx : (i + 1) * ctx] for i in range(count)]
    return [[bos, *window[1:]] if bos is not None else window for window in windows]


def first_scored(ctx: int) -> int:
    """The first chunk position llama-perplexity scores: its logits from n_ctx/2 predict the next token."""
    return ctx // 2 + 1


def q8_0_file(q4_1: Path) -> Path:
    out = root() / "models" / q4_1.name.replace("Q4_1", "Q8_0-from-Q4_1")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        write_q8_0(q4_1, partial)
        partial.rename(out)
    return out


def bos_id(path: Path) -> int:
    return int(GGUFReader(path).fields["tokenizer.ggml.bos_token_id"].contents())


def llama_cpp_ids(model: Path, text_file: Path) -> list[int]:
    printed = subprocess.run(
        [str(binary("llama-tokenize")), "-m", str(model), "-f", str(text_file), "--ids", "--log-disable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return token_ids(printed)


def llama_cpp_perplexity(model: Path, text_file: Path, ctx: int, count: int, threads: int) -> float:
    result = subprocess.run(
        [str(binary("llama-perplexity")), "-m", str(model), "-f", str(text_file), "-c", str(ctx),
         "--chunks", str(count), "-t", str(threads)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return final_perplexity(result.stdout + result.stderr)


def inflight_perplexity(
    model: Path, text: str, ids: list[int], ctx: int, count: int, dtype: str
) -> tuple[float, bool]:
    """Perplexity over llama-perplexity's scored tokens; whether inflight's tokenizer gives the same ids."""
    llm = LLM(str(model), device="cpu", dtype=dtype, max_slots=4)
    try:
        bos = bos_id(model)
        adds_bos = ids[0] == bos
        own = llm.tokenizer.encode(text)
        same_ids = own[: count * ctx] == ids[: count * ctx]
        nll = mean_nll(llm, chunks(ids, ctx, count, bos if adds_bos else None), first_scored(ctx))
    finally:
        llm.close()
    return math.exp(nll), same_ids


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--threads", type=int, default=2, help="llama.cpp threads (inflight: torch's default)"
    )
    args = parser.parse_args()
    q4_1 = builtin_model_path("smollm2")
    text = fixed_text()
    text_file = root() / f"perplexity-text-{TEXT_COMMIT[:12]}.txt"
    text_file.write_text(text)
    rows = []
    for model in (q4_1, q8_0_file(q4_1)):
        ids = llama_cpp_ids(model, text_file)
        reference = llama_cpp_perplexity(model, text_file, args.ctx, args.chunks, args.threads)
        ours, same_ids = inflight_perplexity(model, text, ids, args.ctx, args.chunks, args.dtype)
        rows.append(
            {
                "file": model.name,
                "text_tokens": args.ctx * args.chunks,
                "scored_tokens": args.chunks * (args.ctx - first_scored(args.ctx)),
                "llama_cpp_ppl": round(reference, 4),
                "inflight_ppl": round(ours, 4),
                "inflight_over_llama_cpp": round(ours / reference, 5),
                "inflight_tokenizer_same_ids": same_ids,
            }
        )
    print(f"ctx {args.ctx}, {args.chunks} chunks, inflight dtype {args.dtype}, text docs@{TEXT_COMMIT[:12]}")
    print(f"{'file':44} {'llama.cpp':>10} {'inflight':>10} {'ratio':>8}  same ids")
    for row in rows:
        print(
            f"{row['file']:44} {row['llama_cpp_ppl']:>10.4f} {row['inflight_ppl']:>10.4f} "
            f"{row['inflight_over_llama_cpp']:>8.5f}  {row['inflight_tokenizer_same_ids']}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
