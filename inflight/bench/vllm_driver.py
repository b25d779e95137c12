"""Runs inside vLLM's own virtualenv (not ours): `python -P vllm_driver.py SPEC.json RESULT.json`.

Reads the requests, runs them through `vllm.LLM.generate` and writes the generated token ids and the
timings as JSON. It imports nothing from inflight, which is not installed in that environment.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec: dict[str, Any] = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_slots"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    requests = spec["requests"]
    warmup = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # On a prompt no timed one shares a prefix with (workload.warmup_prompt), so that vLLM's prefix cache
    # holds nothing the timed run can reuse.
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup_prompt"])], warmup, use_tqdm=False)
    setup = time.perf_counter() - start

    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    params = [SamplingParams(max_tokens=r["output_len"], temperature=0.0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": seconds,
        "setup_seconds": setup,
        "vllm_version": vllm.__version__,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
