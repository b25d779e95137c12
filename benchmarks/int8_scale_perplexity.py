"""Perplexity of a float checkpoint quantized at load (`--quantization int8` by default) and unquantized,
over kv_cache_perplexity.py's fixed text (windows scored by their prompt log-probabilities): the check
behind int8's float16 scales (docs/models.md). Point PYTHONPATH at a checkout to measure its quantizer
(main before #30's float16 scales had float32 ones):

    PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/int8_scale_perplexity.py MODEL_DIR \\
        [--dtype float32] [--tokens 4096] [--window 1024] [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import inflight
from inflight import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_cache_perplexity import fixed_text, mean_nll


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--quantization", default="int8")
    args = parser.parse_args()
    results = {}
    for quantization in (args.quantization, "none"):
        llm = LLM(args.model, device="cpu", dtype=args.dtype, quantization=quantization, max_slots=4)
        ids = llm.tokenizer.encode(fixed_text())[: args.tokens]
        windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
        nll = mean_nll(llm, windows)
        llm.close()
        results[quantization] = {"mean_nll": round(nll, 6), "perplexity": round(math.exp(nll), 5)}
    print(json.dumps({"checkout": str(Path(inflight.__file__).parents[1]), "tokens": len(ids), **results}))


if __name__ == "__main__":
    main()
