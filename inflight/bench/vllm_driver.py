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
    llm.generate([TokensPrompt(prompt_token_ids=requests[0]["prompt"])], warmup, use_tqdm=False)
    # The warm-up left request 0's prompt in vLLM's prefix cache: the timed run would skip its prefill (2,601
    # of the 16-request long-prompt workload's 41,696 prompt tokens), where inflight's warm-up prompt is not
    # one of the workload's.
    if not llm.reset_prefix_cache():
        raise RuntimeError(
            "vLLM did not empty its prefix cache after the warm-up: the timed run would reuse it"
        )
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
