"""In one process, a GGUF model's decode step with its block scales as loaded (float16) against the same
model with every quantized matrix's scales widened to float32 (the layout before 4 December: the same
products bit for bit, 2 more bytes read per 32 weights). Two engines, alternated every ROUND_TOKENS
tokens for ROUNDS rounds, so the machine's drift falls on both alike; prints each one's median decode
step (steps with all ROWS sequences decoding) and RSS before and after widening.

    flock /tmp/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/quantized_scales_ab.py MODEL [ROWS]
"""

from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.step_timing import ROUND_TOKENS, ROUNDS, random_prompts, timed_steps
from inflight.bench.system import resident_mib
from inflight.checkpoints.resolve import resolve_model
from inflight.engine.cpu.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedTensor
from inflight.engine.llm import LLM
from inflight.engine.sequence import SamplingParams


def widen_scales(llm: LLM) -> None:
    """Every quantized matrix of `llm`'s model with float32 scales (new tensors: the one-call decode layer
    rebuilds its pointers)."""
    for module in llm.engine.runner.model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            w = module.weight
            mins = None if w.mins is None else w.mins.float()
            module.weight = QuantizedTensor(w.format, w.qweight, w.scales.float(), mins, w.interleaved_rows)


def main() -> None:
    path = resolve_model(sys.argv[1])
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(2)
    as_loaded = LLM(path, max_slots=rows, dtype="bfloat16")
    rss_one = resident_mib()
    widened = LLM(path, max_slots=rows, dtype="bfloat16")
    rss_two = resident_mib()
    widen_scales(widened)
    prompts = random_prompts(as_loaded, rows)
    params = SamplingParams(temperature=0.0, max_tokens=ROUND_TOKENS, ignore_eos=True)
    engines = {"float16 scales": as_loaded, "float32 scales": widened}
    times = {name: timed_steps(llm, rows) for name, llm in engines.items()}
    outputs: dict[str, list[list[int]]] = {}
    for round_ in range(ROUNDS + 1):  # round 0: warm-up, not counted
        for name, llm in engines.items():
            if round_ == 0:
                llm.generate(prompts, params)
                times[name].clear()
                continue
            outputs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    same = outputs["float16 scales"] == outputs["float32 scales"]
    print(f"{path.name} rows={rows}, {ROUNDS} rounds of {ROUND_TOKENS} tokens alternated, same: {same}")
    for name, seconds in times.items():
        median = statistics.median(seconds) * 1e3
        print(f"  {name}: median decode step {median:.2f} ms over {len(seconds)} steps")
    print(f"  RSS: {rss_one} MiB with one engine, {rss_two} MiB with two, {resident_mib()} at the end")


if __name__ == "__main__":
    main()
